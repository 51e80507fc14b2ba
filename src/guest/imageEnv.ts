/**
 * The environment an imported OCI image gives its turns (its config's `Env`): written by
 * `abox image import` at /opt/abox/image-env.json in the image's root (src/lib/oci/rootfs.ts).
 * Turns get it beneath abox's own variables (the egress proxy, the credential placeholders);
 * the other images have no such file, and a file that does not decode gives nothing (logged).
 */
import * as Either from "effect/Either"
import * as Schema from "effect/Schema"
import * as fs from "node:fs/promises"
import { IMAGE_ENV_FILE } from "../domain/image.js"

export const ImageEnv = Schema.Record({ key: Schema.String, value: Schema.String })
const decode = Schema.decodeUnknownEither(Schema.parseJson(ImageEnv))

export const readImageEnv = async (
  log: (line: string) => void,
  file = IMAGE_ENV_FILE
): Promise<Readonly<Record<string, string>>> => {
  let text: string
  try {
    text = await fs.readFile(file, "utf8")
  } catch {
    return {}
  }
  const decoded = decode(text)
  if (Either.isLeft(decoded)) {
    log(`${file} does not decode: the image's environment is left out`)
    return {}
  }
  return decoded.right
}
