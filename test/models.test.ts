import { describe, expect, it } from "@effect/vitest"
import * as Either from "effect/Either"
import * as Schema from "effect/Schema"
import { BrokerPolicy } from "../src/broker/policy.js"
import {
  BUILTIN_CATALOG,
  brokerRulesFor,
  LOCAL_MODEL_HOST,
  localModelRoute,
  mergeCatalog,
  resolveModel
} from "../src/lib/models.js"

describe("the model catalog", () => {
  it("built-in aliases resolve to provider, model id, endpoint and key variable; default is sonnet", () => {
    expect(resolveModel(BUILTIN_CATALOG, "sonnet")).toMatchObject({
      provider: "anthropic",
      id: "claude-sonnet-4-5",
      endpoint: "https://api.anthropic.com",
      hostVariable: "ANTHROPIC_API_KEY"
    })
    expect(resolveModel(BUILTIN_CATALOG, "default")).toEqual(resolveModel(BUILTIN_CATALOG, "sonnet"))
    for (const alias of ["opus", "haiku"])
      expect(resolveModel(BUILTIN_CATALOG, alias)?.provider).toBe("anthropic")
    expect(resolveModel(BUILTIN_CATALOG, "gpt")).toMatchObject({
      provider: "openai",
      endpoint: "https://api.openai.com/v1",
      hostVariable: "OPENAI_API_KEY"
    })
    expect(resolveModel(BUILTIN_CATALOG, "claude-3-7-sonnet-latest")?.id).toBe("claude-3-7-sonnet-latest")
    expect(resolveModel(BUILTIN_CATALOG, "gpt-4.1")?.provider).toBe("openai")
    expect(resolveModel(BUILTIN_CATALOG, "no-such-model")).toBeUndefined()
  })

  it("models.json adds and overrides aliases; aliases of aliases; a local server without a key", () => {
    const catalog = Either.getOrThrow(
      mergeCatalog(
        JSON.stringify({
          format: 1,
          default: "local",
          models: {
            sonnet: { provider: "anthropic", id: "claude-sonnet-next" },
            fast: "haiku",
            local: { provider: "openai", id: "qwen", endpoint: "http://llm.local:8080/v1", apiKeyEnv: null }
          }
        })
      )
    )
    expect(resolveModel(catalog, "sonnet")?.id).toBe("claude-sonnet-next")
    expect(resolveModel(catalog, "fast")?.id).toBe("claude-haiku-4-5")
    const local = resolveModel(catalog, "default")!
    expect(local).toEqual({ provider: "openai", id: "qwen", endpoint: "http://llm.local:8080/v1" })
    // no key, no rule: a local server is reached only by an explicit policy entry
    expect(brokerRulesFor(local)).toEqual({ allow: [], credentials: [] })
  })

  it("api: chat selects the Chat Completions API (openai entries only)", () => {
    const catalog = Either.getOrThrow(
      mergeCatalog(
        JSON.stringify({
          format: 1,
          models: {
            llama: {
              provider: "openai",
              api: "chat",
              id: "qwen",
              endpoint: "https://llm.local:8443/v1",
              apiKeyEnv: null
            },
            resp: { provider: "openai", api: "responses", id: "gpt-x" }
          }
        })
      )
    )
    expect(resolveModel(catalog, "llama")).toEqual({
      provider: "openai",
      api: "chat",
      id: "qwen",
      endpoint: "https://llm.local:8443/v1"
    })
    expect(resolveModel(catalog, "resp")?.api).toBeUndefined()
    const bad = mergeCatalog(
      JSON.stringify({ format: 1, models: { x: { provider: "anthropic", api: "chat", id: "claude-x" } } })
    )
    expect(Either.isLeft(bad)).toBe(true)
    expect(String(Either.isLeft(bad) ? bad.left : "")).toContain("openai entries only")
    expect(
      Either.isLeft(
        mergeCatalog(JSON.stringify({ format: 1, models: { x: { provider: "openai", api: "x", id: "m" } } }))
      )
    ).toBe(true)
  })

  it("a keyless plain-HTTP endpoint on the host's loopback gets a localHttp route; nothing else does", () => {
    const spec = (endpoint: string, hostVariable?: string) => ({
      provider: "openai" as const,
      api: "chat" as const,
      id: "qwen",
      endpoint,
      ...(hostVariable === undefined ? {} : { hostVariable })
    })
    expect(localModelRoute(spec("http://127.0.0.1:11434/v1"))).toEqual({
      spec: spec(`http://${LOCAL_MODEL_HOST}:11434/v1`),
      rule: { host: LOCAL_MODEL_HOST, port: 11434, endpoint: "http://127.0.0.1:11434/v1" }
    })
    expect(localModelRoute(spec("http://localhost:8080/"))?.spec.endpoint).toBe(
      `http://${LOCAL_MODEL_HOST}:8080`
    )
    expect(localModelRoute(spec("http://[::1]:8080/v1"))?.rule.port).toBe(8080)
    expect(localModelRoute(spec("http://127.0.0.1/v1"))?.rule.port).toBe(80)
    for (const endpoint of [
      "https://127.0.0.1:11434/v1",
      "http://192.168.1.20:11434/v1",
      "http://llm.local:11434/v1",
      "http://127.0.0.1:11434/v1?key=x",
      "http://127.0.0.2:11434/v1"
    ])
      expect([endpoint, localModelRoute(spec(endpoint))]).toEqual([endpoint, undefined])
    // a keyed entry is a provider endpoint: brokerRulesFor, not a local route
    expect(localModelRoute(spec("http://127.0.0.1:11434/v1", "LOCAL_LLM_KEY"))).toBeUndefined()
    // the rule decodes as a policy's localHttp
    const route = localModelRoute(spec("http://127.0.0.1:11434/v1"))!
    const decoded = Schema.decodeUnknownEither(BrokerPolicy)({
      format: 1,
      allow: [],
      localHttp: [route.rule]
    })
    expect(Either.isRight(decoded)).toBe(true)
  })

  it("a models.json that does not decode says why", () => {
    const bad = mergeCatalog(JSON.stringify({ format: 1, models: { x: { provider: "mistral", id: "m" } } }))
    expect(Either.isLeft(bad)).toBe(true)
    expect(Either.isLeft(mergeCatalog("{not json"))).toBe(true)
    expect(Either.isLeft(mergeCatalog(JSON.stringify({ format: 2 })))).toBe(true)
  })

  it("the broker rule: the provider's preset on its public API, the same header on another endpoint", () => {
    expect(brokerRulesFor(resolveModel(BUILTIN_CATALOG, "sonnet")!)).toEqual({
      allow: [{ host: "api.anthropic.com", ports: [443] }],
      credentials: [
        {
          host: "api.anthropic.com",
          header: "x-api-key",
          fromEnv: "ANTHROPIC_API_KEY",
          methods: ["GET", "POST"],
          paths: ["/v1/"]
        }
      ]
    })
    expect(
      brokerRulesFor({
        provider: "openai",
        id: "m",
        endpoint: "https://gw.example.com:8443/v1",
        hostVariable: "GW_KEY"
      })
    ).toEqual({
      allow: [{ host: "gw.example.com", ports: [8443] }],
      credentials: [
        {
          host: "gw.example.com",
          header: "Authorization",
          format: "Bearer {}",
          fromEnv: "GW_KEY",
          methods: ["GET", "POST"],
          paths: ["/v1/"]
        }
      ]
    })
    // under the endpoint's own path; any path when it has none
    const rule = (endpoint: string) =>
      brokerRulesFor({ provider: "anthropic", id: "m", endpoint, hostVariable: "K" }).credentials[0]
    expect(rule("https://gw.example.com/team/anthropic/")?.paths).toEqual(["/team/anthropic/"])
    expect(rule("https://gw.example.com:8443")?.paths).toBeUndefined()
  })
})
