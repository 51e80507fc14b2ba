/**
 * The model catalog (docs/on-disk.md "models.json"): a model alias → provider, model id, endpoint,
 * the host's key variable, context window and prices. Built-in aliases (`sonnet`, `opus`, `haiku`
 * for Anthropic; `gpt` for OpenAI; `default` = sonnet), overridden or extended by
 * `$ABOX_HOME/models.json`. The resolved values are secretless and travel in config.raw
 * (GuestConfig.modelSpec); the broker rule for the provider follows from them
 * (`brokerRulesFor`): `ANTHROPIC_API_KEY=… abox open ./repo` needs no policy file.
 *
 * An alias not in the catalog is taken as a model id of the default provider (`claude-…` as
 * Anthropic, `gpt-…`/`o…` as OpenAI), so `--model claude-sonnet-4-5` works without an entry.
 */
import * as Either from "effect/Either"
import * as ParseResult from "effect/ParseResult"
import * as Schema from "effect/Schema"
import type { ModelSpec } from "../protocol/GuestConfig.js"
import {
  parseLoopbackEndpoint,
  presetRules,
  type AllowRule,
  type CredentialRule,
  type LocalHttpRule,
  type PolicyRules
} from "../broker/policy.js"

export const MODEL_CATALOG_FORMAT = 1

export const ModelEntry = Schema.Struct({
  provider: Schema.Literal("anthropic", "openai"),
  /**
   * openai entries only: `responses` (default, `POST {endpoint}/responses`) or `chat` (the Chat
   * Completions API, `POST {endpoint}/chat/completions`: llama.cpp, vLLM, Ollama …)
   */
  api: Schema.optional(Schema.Literal("responses", "chat")),
  id: Schema.String.pipe(Schema.minLength(1)),
  /** default: the provider's public API */
  endpoint: Schema.optional(Schema.String.pipe(Schema.pattern(/^https?:\/\/[^/\s]+/))),
  /**
   * the host's environment variable with the key; default ANTHROPIC_API_KEY / OPENAI_API_KEY;
   * null: no key (a local model server)
   */
  apiKeyEnv: Schema.optional(Schema.NullOr(Schema.String.pipe(Schema.pattern(/^[A-Za-z_][A-Za-z0-9_]*$/)))),
  contextWindow: Schema.optional(Schema.Int.pipe(Schema.positive())),
  maxOutputTokens: Schema.optional(Schema.Int.pipe(Schema.positive())),
  /** US dollars per million input / output tokens */
  inputPrice: Schema.optional(Schema.NonNegative),
  outputPrice: Schema.optional(Schema.NonNegative)
}).pipe(
  Schema.filter((entry) =>
    entry.api === undefined || entry.provider === "openai" ? true : `"api" is for openai entries only`
  )
)
export type ModelEntry = typeof ModelEntry.Type

export const ModelCatalogFile = Schema.Struct({
  format: Schema.Literal(MODEL_CATALOG_FORMAT),
  /** the alias used when a session names none (built-in: sonnet) */
  default: Schema.optional(Schema.String),
  /** an entry's value may also be another alias's name */
  models: Schema.optionalWith(
    Schema.Record({ key: Schema.String, value: Schema.Union(ModelEntry, Schema.String) }),
    {
      default: () => ({})
    }
  )
})
export type ModelCatalogFile = typeof ModelCatalogFile.Type

export interface ModelCatalog {
  readonly default: string
  readonly models: Readonly<Record<string, ModelEntry | string>>
}

export const PROVIDER_ENDPOINTS = {
  anthropic: "https://api.anthropic.com",
  openai: "https://api.openai.com/v1"
} as const
export const PROVIDER_KEY_ENV = { anthropic: "ANTHROPIC_API_KEY", openai: "OPENAI_API_KEY" } as const

export const BUILTIN_CATALOG: ModelCatalog = {
  default: "sonnet",
  models: {
    sonnet: {
      provider: "anthropic",
      id: "claude-sonnet-4-5",
      contextWindow: 200_000,
      maxOutputTokens: 16_000,
      inputPrice: 3,
      outputPrice: 15
    },
    opus: {
      provider: "anthropic",
      id: "claude-opus-4-1",
      contextWindow: 200_000,
      maxOutputTokens: 16_000,
      inputPrice: 15,
      outputPrice: 75
    },
    haiku: {
      provider: "anthropic",
      id: "claude-haiku-4-5",
      contextWindow: 200_000,
      maxOutputTokens: 16_000,
      inputPrice: 1,
      outputPrice: 5
    },
    gpt: {
      provider: "openai",
      id: "gpt-5",
      contextWindow: 400_000,
      maxOutputTokens: 32_000,
      inputPrice: 1.25,
      outputPrice: 10
    }
  }
}

const decodeCatalog = Schema.decodeUnknownEither(Schema.parseJson(ModelCatalogFile))

/** the user's models.json over the built-in catalog; Left: the reason the file does not decode */
export const mergeCatalog = (text: string | undefined): Either.Either<ModelCatalog, string> => {
  if (text === undefined) return Either.right(BUILTIN_CATALOG)
  return Either.mapBoth(decodeCatalog(text), {
    onLeft: (error) => ParseResult.TreeFormatter.formatErrorSync(error),
    onRight: (file): ModelCatalog => ({
      default: file.default ?? BUILTIN_CATALOG.default,
      models: { ...BUILTIN_CATALOG.models, ...file.models }
    })
  })
}

/** the legacy alias of sessions opened before the catalog existed */
const LEGACY_DEFAULT = "default"

/**
 * An alias → the secretless spec the guest gets; undefined when the name is neither an alias
 * nor a recognisable model id.
 */
export const resolveModel = (catalog: ModelCatalog, alias: string): ModelSpec | undefined => {
  let name = alias === LEGACY_DEFAULT && !(LEGACY_DEFAULT in catalog.models) ? catalog.default : alias
  for (let hops = 0; hops < 8; hops++) {
    const entry = Object.hasOwn(catalog.models, name) ? catalog.models[name] : undefined
    if (typeof entry === "string") {
      name = entry
      continue
    }
    const found: ModelEntry | undefined =
      entry ??
      (/^claude-/.test(name)
        ? { provider: "anthropic", id: name }
        : /^(gpt-|o\d)/.test(name)
          ? { provider: "openai", id: name }
          : undefined)
    if (found === undefined) return undefined
    const apiKeyEnv = found.apiKeyEnv === undefined ? PROVIDER_KEY_ENV[found.provider] : found.apiKeyEnv
    return {
      provider: found.provider,
      id: found.id,
      ...(found.api === "chat" ? { api: "chat" as const } : {}),
      endpoint: found.endpoint ?? PROVIDER_ENDPOINTS[found.provider],
      ...(apiKeyEnv === null ? {} : { hostVariable: apiKeyEnv }),
      ...(found.contextWindow === undefined ? {} : { contextWindow: found.contextWindow }),
      ...(found.maxOutputTokens === undefined ? {} : { outputLimit: found.maxOutputTokens }),
      ...(found.inputPrice === undefined ? {} : { inputPrice: found.inputPrice }),
      ...(found.outputPrice === undefined ? {} : { outputPrice: found.outputPrice })
    }
  }
  return undefined
}

const endpointHostPort = (endpoint: string): { readonly host: string; readonly port: number } => {
  const url = new URL(endpoint)
  return {
    host: url.hostname.toLowerCase(),
    port: Number(url.port) || (url.protocol === "https:" ? 443 : 80)
  }
}

/**
 * The broker rules a model needs: its endpoint allowed, with the provider's credential header
 * from the host's key variable. None for a model without a key variable (a local model server:
 * reached only by an explicit policy entry). The provider's preset where the endpoint is its
 * public API; the same header shape on the endpoint's own host and port otherwise.
 */
export const brokerRulesFor = (spec: ModelSpec): PolicyRules => {
  if (spec.hostVariable === undefined) return { allow: [], credentials: [] }
  const { host, port } = endpointHostPort(spec.endpoint)
  const preset = presetRules(spec.provider, { fromEnv: spec.hostVariable })
  const presetHost = endpointHostPort(PROVIDER_ENDPOINTS[spec.provider]).host
  if (host === presetHost && port === 443) return preset
  const allow: ReadonlyArray<AllowRule> = [{ host, ports: [port] }]
  // the client calls paths under the endpoint's own: the key goes on those only (any path at "/")
  const base = new URL(spec.endpoint).pathname.replace(/\/+$/, "")
  const credentials: ReadonlyArray<CredentialRule> = preset.credentials.map(({ paths: _paths, ...rule }) => ({
    ...rule,
    host,
    ...(base === "" ? {} : { paths: [`${base}/`] })
  }))
  return { allow, credentials }
}

/** the name the guest reaches a keyless model server on the host's loopback by (docs/broker.md) */
export const LOCAL_MODEL_HOST = "local-model.abox.internal"

/**
 * A keyless model whose endpoint is plain HTTP on the host's loopback (`http://127.0.0.1:11434/v1`,
 * Ollama; llama.cpp's server): the catalog entry is the user's consent to reach exactly that
 * endpoint. The guest gets the spec with its endpoint under `LOCAL_MODEL_HOST` (same port and
 * path), and the broker a `localHttp` rule mapping that name to the loopback endpoint. Undefined
 * for every other model.
 */
export const localModelRoute = (
  spec: ModelSpec
): { readonly spec: ModelSpec; readonly rule: LocalHttpRule } | undefined => {
  if (spec.hostVariable !== undefined) return undefined
  const endpoint = parseLoopbackEndpoint(spec.endpoint)
  if (endpoint === undefined) return undefined
  return {
    spec: { ...spec, endpoint: `http://${LOCAL_MODEL_HOST}:${endpoint.port}${endpoint.pathPrefix}` },
    rule: { host: LOCAL_MODEL_HOST, port: endpoint.port, endpoint: spec.endpoint }
  }
}

/** `$ABOX_HOME/models.json` does not decode: the file is left as it is */
export class ModelCatalogError extends Schema.TaggedError<ModelCatalogError>()("ModelCatalogError", {
  path: Schema.String,
  message: Schema.String
}) {}
