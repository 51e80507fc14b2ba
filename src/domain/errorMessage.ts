/** the message of a thrown value: an Error's message, anything else as a string */
export const errorMessage = (cause: unknown): string =>
  cause instanceof Error ? cause.message : String(cause)
