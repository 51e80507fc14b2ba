import forge from "node-forge"
import * as crypto from "node:crypto"

/**
 * A per-session certificate authority for the broker's TLS termination. The CA key exists only
 * in this object (host memory); only `certPem` leaves it (to the guest's trust store). Leaf
 * certificates are made per host on demand and cached; all leaves share one key pair.
 */
export interface SessionCa {
  readonly certPem: string
  /** PEM cert + key for `host` (cached) */
  readonly leaf: (host: string) => { readonly certPem: string; readonly keyPem: string }
}

const randomSerial = () => {
  const bytes = crypto.randomBytes(16)
  bytes[0] = bytes[0]! & 0x7f // positive
  return bytes.toString("hex")
}

/** native key generation off the event loop, converted for forge's certificate code */
const rsaKeyPair = (): Promise<forge.pki.rsa.KeyPair> =>
  new Promise((resolve, reject) =>
    crypto.generateKeyPair(
      "rsa",
      { modulusLength: 2048, publicExponent: 0x10001 },
      (error, publicKey, privateKey) => {
        if (error) return reject(error)
        resolve({
          publicKey: forge.pki.publicKeyFromPem(publicKey.export({ type: "spki", format: "pem" }).toString()),
          privateKey: forge.pki.privateKeyFromPem(
            privateKey.export({ type: "pkcs1", format: "pem" }).toString()
          )
        })
      }
    )
  )

const HOUR = 60 * 60 * 1000

export interface CaOptions {
  readonly commonName: string
  /** validity of the CA and its leaves from now */
  readonly validDays?: number
}

export const makeSessionCa = async (options: CaOptions): Promise<SessionCa> => {
  const now = Date.now()
  const notBefore = new Date(now - HOUR)
  const notAfter = new Date(now + (options.validDays ?? 30) * 24 * HOUR)
  const [caKeys, leafKeys] = await Promise.all([rsaKeyPair(), rsaKeyPair()])
  const caCert = forge.pki.createCertificate()
  caCert.publicKey = caKeys.publicKey
  caCert.serialNumber = randomSerial()
  caCert.validity.notBefore = notBefore
  caCert.validity.notAfter = notAfter
  const caSubject = [
    { name: "commonName", value: options.commonName },
    { name: "organizationName", value: "abox session broker" }
  ]
  caCert.setSubject(caSubject)
  caCert.setIssuer(caSubject)
  caCert.setExtensions([
    { name: "basicConstraints", cA: true, pathLenConstraint: 0, critical: true },
    { name: "keyUsage", keyCertSign: true, cRLSign: true, critical: true },
    { name: "subjectKeyIdentifier" }
  ])
  caCert.sign(caKeys.privateKey, forge.md.sha256.create())
  const certPem = forge.pki.certificateToPem(caCert)

  const leafKeyPem = forge.pki.privateKeyToPem(leafKeys.privateKey)
  const leaves = new Map<string, { certPem: string; keyPem: string }>()

  const leaf = (host: string) => {
    const cached = leaves.get(host)
    if (cached !== undefined) return cached
    const cert = forge.pki.createCertificate()
    cert.publicKey = leafKeys.publicKey
    cert.serialNumber = randomSerial()
    cert.validity.notBefore = notBefore
    cert.validity.notAfter = notAfter
    cert.setSubject([{ name: "commonName", value: host }])
    cert.setIssuer(caSubject)
    cert.setExtensions([
      { name: "basicConstraints", cA: false, critical: true },
      { name: "keyUsage", digitalSignature: true, keyEncipherment: true, critical: true },
      { name: "extKeyUsage", serverAuth: true },
      { name: "subjectAltName", altNames: [{ type: 2, value: host }] },
      { name: "authorityKeyIdentifier", keyIdentifier: caCert.generateSubjectKeyIdentifier().getBytes() }
    ])
    cert.sign(caKeys.privateKey, forge.md.sha256.create())
    const made = { certPem: forge.pki.certificateToPem(cert), keyPem: leafKeyPem }
    leaves.set(host, made)
    return made
  }
  return { certPem, leaf }
}
