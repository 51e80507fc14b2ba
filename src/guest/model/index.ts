/**
 * The model agent (bundled apart, dist/abox-guest-model.cjs, and loaded only on the first prompt
 * turn: the agent's start stays free of the model stack). `createModelAgent` builds, once, the
 * provider's LanguageModel over an HTTP client whose every connection is a CONNECT through the
 * guest's egress proxy (so the broker decides, and adds the key) and trusts the session CA.
 *
 * This module is an edge: a turn is one fiber of a ManagedRuntime, interrupted by `cancel`.
 */
import * as net from "node:net"
import * as tls from "node:tls"
import * as AnthropicClient from "@effect/ai-anthropic/AnthropicClient"
import * as AnthropicLanguageModel from "@effect/ai-anthropic/AnthropicLanguageModel"
import * as OpenAiClient from "@effect/ai-openai/OpenAiClient"
import * as OpenAiLanguageModel from "@effect/ai-openai/OpenAiLanguageModel"
import type * as LanguageModel from "@effect/ai/LanguageModel"
import * as Prompt from "@effect/ai/Prompt"
import * as NodeHttpClient from "@effect/platform-node/NodeHttpClient"
import * as HttpClient from "@effect/platform/HttpClient"
import type * as HttpClientResponse from "@effect/platform/HttpClientResponse"
import * as Cause from "effect/Cause"
import * as Option from "effect/Option"
import * as Queue from "effect/Queue"
import * as Stream from "effect/Stream"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import * as Layer from "effect/Layer"
import * as ManagedRuntime from "effect/ManagedRuntime"
import * as Redacted from "effect/Redacted"
import { Agent, type buildConnector } from "undici"
import type { ModelSpec } from "../../protocol/GuestConfig.js"
import type { AgentEvent, TurnLimits } from "../../protocol/Messages.js"
import { CREDENTIAL_PLACEHOLDER } from "../../protocol/GuestConfig.js"
import type { TurnUser } from "../user.js"
import * as ChatLanguageModel from "./chat.js"
import { pathsSeen, ReadLedger } from "./fileText.js"
import { instructionsSection, readInstructions } from "./instructions.js"
import {
  DEFAULT_MAX_STEPS,
  messagesOf,
  promptFromMessages,
  promptTurn,
  SYSTEM_PROMPT,
  type Conversation
} from "./loop.js"
import { FileOpChild } from "./ownerFiles.js"
import { AgentToolkit, killAllTools, makeHandlers, resolveRepoPath } from "./tools.js"

export interface ModelAgentOptions {
  /** absent: every prompt turn ends with an error saying so */
  readonly spec: ModelSpec | undefined
  readonly maxSteps?: number | undefined
  readonly repoDir: string
  readonly user: TurnUser | undefined
  /** the environment of tool processes */
  readonly env: Readonly<Record<string, string>>
  /** the conversation so far (context.json `messages`) */
  readonly messages: ReadonlyArray<unknown>
  /** the egress proxy (127.0.0.1:port); absent: direct connections (tests) */
  readonly proxyPort?: number | undefined
  /** extra CAs to trust (the session's broker CA) */
  readonly caPems?: ReadonlyArray<string> | undefined
  readonly log: (line: string) => void
  /**
   * after each completed step of a prompt turn, the conversation so far (context.json is saved:
   * a VM killed mid-turn loses no finished step); awaited before the next step
   */
  readonly onStep?: ((messages: ReadonlyArray<unknown>) => Promise<void>) | undefined
}

export interface PromptOutcome {
  readonly reason: "done" | "max_steps" | "max_cost" | "cancelled" | "error"
  readonly steps: number
  readonly message?: string | undefined
}

export interface ModelAgent {
  /** one prompt turn; events are awaited (back pressure); `limits` over the session's max steps */
  readonly run: (
    text: string,
    sink: (event: AgentEvent) => Promise<void> | void,
    limits?: TurnLimits
  ) => Promise<PromptOutcome>
  /** interrupt the running turn (stream and tool at once); true when one was running */
  readonly cancel: () => boolean
  /** the conversation as context.json keeps it */
  readonly messages: () => ReadonlyArray<unknown>
  readonly close: () => Promise<void>
  /** synchronous last resort (SIGTERM to the agent): SIGKILL every running tool's process group */
  readonly killNow: () => void
}

const DENY_HEADER = /^x-abox-deny-reason:\s*(.*)$/im

/**
 * An undici connector: CONNECT host:port through the proxy (or a direct socket), then TLS for
 * https. A refusal's reason (the broker's, in X-Abox-Deny-Reason) is kept for the error message.
 */
const tunnelConnector = (
  proxyPort: number | undefined,
  ca: ReadonlyArray<string>,
  onRefusal: (why: string) => void
): buildConnector.connector => {
  // built once, on the first connection: parsing the ~150 roots for every TLS connection was the
  // largest item of the agent's own CPU profile after module loading
  let secureContext: tls.SecureContext | undefined
  const context = () => (secureContext ??= tls.createSecureContext({ ca: [...ca] }))
  return (options, callback) => {
    const host = options.hostname
    const port = Number(options.port) || (options.protocol === "https:" ? 443 : 80)
    const secure = (socket: net.Socket) => {
      if (options.protocol !== "https:") return callback(null, socket)
      const tlsSocket = tls.connect({
        socket,
        servername: options.servername ?? host,
        secureContext: context(),
        ALPNProtocols: ["http/1.1"]
      })
      tlsSocket.once("secureConnect", () => callback(null, tlsSocket))
      tlsSocket.once("error", (error) => callback(error, null))
    }
    if (proxyPort === undefined) {
      const socket = net.connect({ host, port })
      socket.once("connect", () => secure(socket))
      socket.once("error", (error) => callback(error, null))
      return
    }
    const socket = net.connect({ host: "127.0.0.1", port: proxyPort })
    let head = Buffer.alloc(0)
    const onError = (error: Error) => callback(error, null)
    socket.once("error", onError)
    socket.once("connect", () =>
      socket.write(`CONNECT ${host}:${port} HTTP/1.1\r\nHost: ${host}:${port}\r\n\r\n`)
    )
    const onData = (chunk: Buffer) => {
      head = Buffer.concat([head, chunk])
      const end = head.indexOf("\r\n\r\n")
      if (end < 0) {
        if (head.length > 16 * 1024) {
          socket.destroy()
          callback(new Error("the egress proxy sent an oversized answer"), null)
        }
        return
      }
      socket.off("data", onData)
      socket.off("error", onError)
      const text = head.subarray(0, end).toString("latin1")
      const status = Number(text.split(" ")[1])
      if (status !== 200) {
        socket.destroy()
        const reason = DENY_HEADER.exec(text)?.[1]?.trim() ?? `proxy answered ${status}`
        onRefusal(`${host}:${port}: ${reason}`)
        return callback(new Error(`the broker refused ${host}:${port}: ${reason}`), null)
      }
      socket.pause()
      const rest = head.subarray(end + 4)
      if (rest.length > 0) socket.unshift(rest)
      secure(socket)
    }
    socket.on("data", onData)
  }
}

/**
 * Streamed answers end with an event the provider client stops at (`message_stop`,
 * `response.completed`), before the body's own end may have arrived through the broker; undici
 * then drops the connection, and every model request paid a new tunnel and two TLS handshakes.
 * Here the body is read to its end by a fiber of its own (bounded), so the connection goes back to
 * the pool; a consumer that stops with a failure or an interruption (cancel) stops the reading.
 */
const DRAIN_BOUND = "5 seconds"
const drainToEnd = (
  response: HttpClientResponse.HttpClientResponse
): HttpClientResponse.HttpClientResponse => {
  const stream = Stream.unwrapScoped(
    Effect.gen(function* () {
      const queue = yield* Queue.unbounded<Exit.Exit<Uint8Array, Option.Option<unknown>>>()
      const reader = yield* response.stream.pipe(
        Stream.runForEach((chunk) => Queue.offer(queue, Exit.succeed(chunk))),
        Effect.matchCauseEffect({
          onFailure: (cause) => Queue.offer(queue, Exit.failCause(Cause.map(cause, Option.some))),
          onSuccess: () => Queue.offer(queue, Exit.fail(Option.none()))
        }),
        Effect.forkDaemon
      )
      yield* Effect.addFinalizer((exit) =>
        Exit.isSuccess(exit)
          ? // the consumer is done: let the reader reach the body's end, within a bound
            Fiber.await(reader).pipe(
              Effect.timeout(DRAIN_BOUND),
              Effect.catchAll(() => Fiber.interrupt(reader)),
              Effect.forkDaemon,
              Effect.asVoid
            )
          : Effect.asVoid(Fiber.interrupt(reader))
      )
      return Stream.repeatEffectOption(Effect.flatten(Queue.take(queue)))
    })
  ) as typeof response.stream
  return Object.create(response, { stream: { value: stream } }) as HttpClientResponse.HttpClientResponse
}

const languageModelLayer = (spec: ModelSpec, http: Layer.Layer<HttpClient.HttpClient>) => {
  // the broker replaces the placeholder with the host's key; the guest never holds one
  const apiKey = Redacted.make(CREDENTIAL_PLACEHOLDER)
  if (spec.provider === "anthropic") {
    return AnthropicLanguageModel.layer({
      model: spec.id,
      config: { max_tokens: spec.outputLimit ?? 8192 }
    }).pipe(Layer.provide(AnthropicClient.layer({ apiKey, apiUrl: spec.endpoint })), Layer.provide(http))
  }
  const client = OpenAiClient.layer({ apiKey, apiUrl: spec.endpoint })
  if (spec.api === "chat") {
    return ChatLanguageModel.layer({ model: spec.id, maxTokens: spec.outputLimit }).pipe(
      Layer.provide(client),
      Layer.provide(http)
    )
  }
  return OpenAiLanguageModel.layer({
    model: spec.id,
    ...(spec.outputLimit === undefined ? {} : { config: { max_output_tokens: spec.outputLimit } })
  }).pipe(Layer.provide(client), Layer.provide(http))
}

export const createModelAgent = (options: ModelAgentOptions): ModelAgent => {
  const restored = promptFromMessages(options.messages)
  if (Either.isLeft(restored)) {
    options.log(`the conversation in context.json did not decode (${restored.left}); starting a new one`)
  }
  const conversation: Conversation = { prompt: Either.getOrElse(restored, () => Prompt.empty) }
  let lastRefusal: string | undefined
  const dispatcher = new Agent({
    connect: tunnelConnector(
      options.proxyPort,
      [...tls.rootCertificates, ...(options.caPems ?? [])],
      (why) => {
        lastRefusal = why
      }
    ),
    // a model answer may pause for minutes while it thinks
    bodyTimeout: 10 * 60 * 1000,
    headersTimeout: 10 * 60 * 1000
  })
  const http = Layer.succeed(
    HttpClient.HttpClient,
    HttpClient.transformResponse(NodeHttpClient.makeUndici(dispatcher), (response) =>
      Effect.map(response, (r) => drainToEnd(r))
    )
  )
  const spec = options.spec
  const runtime =
    spec === undefined
      ? undefined
      : ManagedRuntime.make(languageModelLayer(spec, http) as Layer.Layer<LanguageModel.LanguageModel>)
  // what the model read in this conversation, its restored part included (edit_file needs it)
  const ledger = new ReadLedger()
  for (const file of pathsSeen(options.messages)) {
    const resolved = resolveRepoPath(options.repoDir, file)
    if (resolved.ok) ledger.add(resolved.path)
  }
  // the owner's file-operation child: started by the session's first file tool and kept for the
  // ones after (a node start is ~0.4 s under TCG); a cancel or a stall in an operation ends it,
  // and the next operation starts another
  const files = new FileOpChild(options.user, options.repoDir)
  const tools = { repoDir: options.repoDir, user: options.user, env: options.env, ledger, files }
  const toolkitLayer = AgentToolkit.toLayer(makeHandlers(tools))
  let running: Fiber.RuntimeFiber<PromptOutcome> | undefined

  const run: ModelAgent["run"] = async (text, sink, limits) => {
    if (runtime === undefined || spec === undefined) {
      const message =
        "no model is configured for this session: its --model alias is not in the model catalog (docs/on-disk.md, models.json); shell commands still work"
      await sink({ kind: "agent_end", reason: "error", steps: 0, message })
      return { reason: "error", steps: 0, message }
    }
    lastRefusal = undefined
    const emit = (event: AgentEvent) => Effect.promise(() => Promise.resolve(sink(event)))
    const turn = Effect.gen(function* () {
      const toolkit = yield* AgentToolkit.pipe(Effect.provide(toolkitLayer))
      // the repository's AGENTS.md / CLAUDE.md, read afresh for each turn
      const instructions = instructionsSection(yield* readInstructions(tools))
      const onStep = options.onStep
      return yield* promptTurn(text, conversation, toolkit, {
        spec,
        maxSteps: limits?.maxSteps ?? options.maxSteps ?? DEFAULT_MAX_STEPS,
        maxCostUsd: limits?.maxCostUsd,
        systemPrompt: instructions === undefined ? SYSTEM_PROMPT : `${SYSTEM_PROMPT}\n\n${instructions}`,
        // uninterruptible: a cancel waits for the save in progress, never races the turn's last one
        onStep:
          onStep === undefined
            ? undefined
            : () => Effect.uninterruptible(Effect.promise(() => onStep(messagesOf(conversation.prompt)))),
        emit,
        lastRefusal: () => lastRefusal
      })
    })
    const fiber = runtime.runFork(turn)
    running = fiber
    const exit = await runtime.runPromise(Fiber.await(fiber))
    if (running === fiber) running = undefined
    const outcome: PromptOutcome = Exit.isSuccess(exit)
      ? exit.value
      : Exit.isInterrupted(exit)
        ? { reason: "cancelled", steps: 0, message: "cancelled" }
        : { reason: "error", steps: 0, message: `the agent failed: ${String(exit.cause)}` }
    await sink({
      kind: "agent_end",
      reason: outcome.reason,
      steps: outcome.steps,
      ...(outcome.message === undefined ? {} : { message: outcome.message })
    })
    return outcome
  }

  return {
    run,
    cancel: () => {
      const fiber = running
      if (fiber === undefined || runtime === undefined) return false
      runtime.runFork(Fiber.interrupt(fiber))
      return true
    },
    messages: () => messagesOf(conversation.prompt),
    killNow: killAllTools,
    close: async () => {
      if (running !== undefined && runtime !== undefined) await runtime.runPromise(Fiber.interrupt(running))
      await runtime?.dispose()
      files.close()
      await dispatcher.close().catch(() => undefined)
    }
  }
}
