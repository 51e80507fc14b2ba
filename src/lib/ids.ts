import * as crypto from "node:crypto"

/**
 * Session ids: 26 characters of lowercase Crockford base32 (`[0-9a-z]` minus i, l, o, u),
 * 10 for the creation time in milliseconds, then 16 of randomness (80 bits), like a ULID.
 * Ids made later sort after earlier ones as plain strings; within one millisecond of one
 * process the random part is incremented, so order holds there too.
 */
export const ID_ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"
export const ID_LENGTH = 26
const TIME_CHARS = 10
const RANDOM_CHARS = 16

export const ID_PATTERN = /^[0-9a-hjkmnp-tv-z]{26}$/

export const isSessionId = (s: string): boolean => ID_PATTERN.test(s)

const encodeTime = (ms: number): string => {
  let out = ""
  let t = Math.max(0, Math.floor(ms))
  for (let i = 0; i < TIME_CHARS; i++) {
    out = ID_ALPHABET[t % 32] + out
    t = Math.floor(t / 32)
  }
  return out
}

/** 16 base32 digits (5 bits each) from random bytes */
const randomDigits = (bytes: Uint8Array): Array<number> => {
  const digits: Array<number> = []
  for (let i = 0; i < RANDOM_CHARS; i++) digits.push(bytes[i]! & 31)
  return digits
}

/** adds one to a base-32 digit array; false on overflow */
const increment = (digits: Array<number>): boolean => {
  for (let i = digits.length - 1; i >= 0; i--) {
    if (digits[i]! < 31) {
      digits[i]! += 1
      return true
    }
    digits[i] = 0
  }
  return false
}

export interface IdGenerator {
  readonly next: (nowMs: number) => string
}

/** A monotonic id generator (one per process is enough; the store owns one). */
export const makeIdGenerator = (
  random: (n: number) => Uint8Array = (n) => crypto.randomBytes(n)
): IdGenerator => {
  let lastTime = -1
  let lastRandom: Array<number> = []
  return {
    next: (nowMs) => {
      let time = Math.floor(nowMs)
      if (time <= lastTime) {
        time = lastTime
        if (!increment(lastRandom)) {
          // 2^80 ids in one millisecond: borrow the next millisecond
          time = lastTime + 1
          lastRandom = randomDigits(random(RANDOM_CHARS))
        }
      } else {
        lastRandom = randomDigits(random(RANDOM_CHARS))
      }
      lastTime = time
      return encodeTime(time) + lastRandom.map((d) => ID_ALPHABET[d]).join("")
    }
  }
}

/** the creation time encoded in an id, in milliseconds */
export const idTime = (id: string): number => {
  let t = 0
  for (const c of id.slice(0, TIME_CHARS)) t = t * 32 + ID_ALPHABET.indexOf(c)
  return t
}
