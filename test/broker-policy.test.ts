import { describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Schema from "effect/Schema"
import {
  BrokerPolicy,
  credentialHeaderValue,
  credentialOutside,
  decide,
  decodePolicy,
  decodePolicyJson,
  parseResolveTarget,
  presetRules,
  withRules
} from "../src/broker/policy.js"

describe("broker policy presets", () => {
  it.effect("anthropic, openai and github expand to their allow and credential rules", () =>
    Effect.gen(function* () {
      const policy = yield* decodePolicyJson(
        JSON.stringify({
          format: 1,
          allow: [],
          credentials: [
            { preset: "anthropic", fromEnv: "ANTHROPIC_API_KEY" },
            { preset: "openai", fromEnv: "OPENAI_API_KEY" },
            { preset: "github", fromFile: "~/.config/gh-token" }
          ]
        })
      )
      expect(policy.allow).toEqual([
        { host: "api.anthropic.com", ports: [443] },
        { host: "api.openai.com", ports: [443] },
        { host: "github.com", ports: [443] },
        { host: "api.github.com", ports: [443] }
      ])
      expect(policy.credentials).toEqual([
        {
          host: "api.anthropic.com",
          header: "x-api-key",
          fromEnv: "ANTHROPIC_API_KEY",
          methods: ["GET", "POST"],
          paths: ["/v1/"]
        },
        {
          host: "api.openai.com",
          header: "Authorization",
          format: "Bearer {}",
          fromEnv: "OPENAI_API_KEY",
          methods: ["GET", "POST"],
          paths: ["/v1/"]
        },
        {
          host: "github.com",
          header: "Authorization",
          basicUser: "x-access-token",
          fromFile: "~/.config/gh-token",
          methods: ["GET", "POST"]
        },
        {
          host: "api.github.com",
          header: "Authorization",
          format: "Bearer {}",
          fromFile: "~/.config/gh-token"
        }
      ])
      const decision = decide(policy, "API.Anthropic.com", 443)
      expect(decision).toMatchObject({ allow: true, host: "api.anthropic.com" })
      expect(decision.allow && decision.credential?.header).toBe("x-api-key")
      expect(decide(policy, "api.anthropic.com", 80)).toEqual({ allow: false, reason: "port-not-allowed" })
    })
  )

  it.effect("a rule spelled out wins over a preset for the same host; nothing is duplicated", () =>
    Effect.gen(function* () {
      const policy = yield* decodePolicy({
        format: 1,
        allow: [{ host: "api.anthropic.com", ports: [443] }],
        credentials: [
          { preset: "anthropic", fromEnv: "A" },
          { host: "api.anthropic.com", header: "Authorization", fromEnv: "B", format: "Bearer {}" },
          { preset: "anthropic", fromEnv: "C" }
        ]
      })
      expect(policy.allow).toEqual([{ host: "api.anthropic.com", ports: [443] }])
      expect(policy.credentials).toEqual([
        { host: "api.anthropic.com", header: "Authorization", fromEnv: "B", format: "Bearer {}" }
      ])
    })
  )

  it.effect("an expanded policy encodes (session.json) and decodes to itself", () =>
    Effect.gen(function* () {
      const policy = yield* decodePolicy({
        format: 1,
        allow: [],
        credentials: [{ preset: "github", fromEnv: "GH_TOKEN" }],
        resolve: { "github.com": "127.0.0.1:8443" },
        upstreamCaFiles: ["/etc/corp-ca.pem"]
      })
      const again = yield* decodePolicy(yield* Schema.encode(BrokerPolicy)(policy))
      expect(again).toEqual(policy)
    })
  )

  it("an unknown preset or a preset without a source is refused", () => {
    const bad = (rule: unknown) =>
      Either.isLeft(Schema.decodeUnknownEither(BrokerPolicy)({ format: 1, allow: [], credentials: [rule] }))
    expect(bad({ preset: "anthropic" })).toBe(true)
    expect(bad({ preset: "gemini", fromEnv: "K" })).toBe(true)
    expect(bad({ preset: "anthropic", fromEnv: "not a name" })).toBe(true)
    expect(bad({ preset: "anthropic", fromEnv: "K" })).toBe(false)
  })

  it("presetRules and withRules give code the rules without a policy file", () => {
    const rules = presetRules("openai", { fromEnv: "OPENAI_API_KEY" })
    const policy = withRules({ format: 1 as const, allow: [], credentials: [], resolve: {} }, rules)
    expect(decide(policy, "api.openai.com", 443)).toMatchObject({
      allow: true,
      credential: { header: "Authorization", format: "Bearer {}", fromEnv: "OPENAI_API_KEY" }
    })
    expect(withRules(policy, rules)).toEqual(policy)
  })

  it("header values: format, then basic auth for git over HTTPS", () => {
    const [github, api] = presetRules("github", { fromEnv: "GH_TOKEN" }).credentials
    expect(credentialHeaderValue(github!, "ghp_x")).toBe(
      `Basic ${Buffer.from("x-access-token:ghp_x").toString("base64")}`
    )
    expect(credentialHeaderValue(api!, "ghp_x")).toBe("Bearer ghp_x")
  })
})

describe("broker policy: a credential rule's methods and paths", () => {
  it.effect("decode: upper-case methods, origin-form prefixes without query, escapes or dot segments", () =>
    Effect.gen(function* () {
      const rule = (extra: object) => ({
        format: 1,
        allow: [{ host: "api.example.com", ports: [443] }],
        credentials: [{ host: "api.example.com", header: "x-api-key", fromEnv: "K", ...extra }]
      })
      const policy = yield* decodePolicy(rule({ methods: ["POST"], paths: ["/v1/", "/v2/models"] }))
      expect(policy.credentials[0]).toMatchObject({ methods: ["POST"], paths: ["/v1/", "/v2/models"] })
      const bad = (extra: object) => Either.isLeft(Schema.decodeUnknownEither(BrokerPolicy)(rule(extra)))
      for (const extra of [
        { methods: [] },
        { methods: ["post"] },
        { methods: ["PO ST"] },
        { paths: [] },
        { paths: ["v1/"] },
        { paths: ["/v1/?x=1"] },
        { paths: ["/v1/%2e%2e/"] },
        { paths: ["/v1/../admin/"] },
        { paths: ["/v1\\admin"] }
      ])
        expect(bad(extra)).toBe(true)
      expect(bad({})).toBe(false)
    })
  )

  it("which requests a rule's credential goes on", () => {
    const rule = {
      host: "api.example.com",
      header: "x-api-key",
      fromEnv: "K",
      methods: ["GET", "POST"],
      paths: ["/v1/"]
    } as const
    expect(credentialOutside(rule, "POST", "/v1/messages?beta=true")).toBeUndefined()
    expect(credentialOutside(rule, "GET", "/v1/models")).toBeUndefined()
    expect(credentialOutside(rule, "DELETE", "/v1/files/x")).toBe("method")
    expect(credentialOutside(rule, "HEAD", "/")).toBe("method")
    for (const target of [
      "/",
      "/v1",
      "/v10/x",
      "/admin?next=/v1/",
      "/v1/../admin",
      "/v1/./../admin",
      "/v1/%2e%2e/admin",
      "/v1/%2E./admin",
      "/v1/..%2fadmin",
      "/v1/x%5c..%5cadmin",
      "/v1\\..\\admin",
      "*"
    ])
      expect(credentialOutside(rule, "POST", target)).toBe("path")
    // no lists: every method, every path
    expect(credentialOutside({ host: "h", header: "x", fromEnv: "K" }, "PATCH", "/../x")).toBeUndefined()
  })
})

describe("broker policy resolve", () => {
  it("takes an address, or an address and a port", () => {
    expect(parseResolveTarget("127.0.0.1")).toEqual({ address: "127.0.0.1", port: undefined })
    expect(parseResolveTarget("127.0.0.1:8443")).toEqual({ address: "127.0.0.1", port: 8443 })
    expect(parseResolveTarget("[::1]:8443")).toEqual({ address: "::1", port: 8443 })
    expect(parseResolveTarget("::1")).toEqual({ address: "::1", port: undefined })
    expect(parseResolveTarget("127.0.0.1:0")).toBeUndefined()
    expect(parseResolveTarget("127.0.0.1:70000")).toBeUndefined()
    expect(parseResolveTarget("example.com:443")).toBeUndefined()
  })

  it.effect("decide pins the address and port", () =>
    Effect.gen(function* () {
      const policy = yield* decodePolicy({
        format: 1,
        allow: [{ host: "api.test", ports: [443] }],
        resolve: { "api.test": "127.0.0.1:8443" }
      })
      expect(decide(policy, "api.test", 443)).toMatchObject({
        allow: true,
        pinned: { address: "127.0.0.1", port: 8443 }
      })
    })
  )
})
