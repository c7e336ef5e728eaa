/**
 * Durations: `"15m"`, `"2m30s"`, `"1h"`, `"90s"`, `"250ms"` or a number of seconds. The
 * grammar is the daemon's (cpuos_agent.protocol.parse_duration); both are checked against
 * tests/vectors/durations.json.
 */
export type Duration = string | number;

const UNITS: Record<string, number> = { ms: 0.001, s: 1, m: 60, h: 3600, d: 86400 };
const PART = /(\d+(?:\.\d+)?)(ms|s|m|h|d)/y;
const NUMBER = /^[+-]?(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?$/;

/** Seconds; throws a RangeError with a readable message on anything else. */
export function parseDuration(value: unknown, what = "duration"): number {
  let seconds: number;
  if (typeof value === "number") {
    seconds = value;
  } else if (typeof value === "string") {
    const s = value.trim().toLowerCase().replaceAll(" ", "");
    if (NUMBER.test(s)) {
      seconds = Number(s);
    } else {
      seconds = 0;
      let pos = 0;
      PART.lastIndex = 0;
      for (let m = PART.exec(s); m !== null; m = PART.exec(s)) {
        seconds += Number(m[1]) * (UNITS[m[2] as string] as number);
        pos = PART.lastIndex;
      }
      if (pos !== s.length || s.length === 0) {
        throw new RangeError(
          `${what}: bad duration ${JSON.stringify(value)}; use e.g. '15m', '2m30s', '1h' or seconds`);
      }
    }
  } else {
    throw new RangeError(
      `${what}: expected a duration like '15m' or seconds, got ${JSON.stringify(value)}`);
  }
  if (!Number.isFinite(seconds) || seconds <= 0) {
    throw new RangeError(`${what}: must be a positive duration, got ${JSON.stringify(value)}`);
  }
  return seconds;
}

/** Sizes: "512MiB", "1GiB", "1.5G", "2048M" (powers of 1024 either way) or a number of MiB.
 * The daemon's grammar (cpuos_agent.protocol.parse_size_mib), checked against
 * tests/vectors/sizes.json. */
export type Size = string | number;

const SIZE = /^(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?$/;
const SIZE_MIB: Record<string, number> = { k: 1 / 1024, "": 1, m: 1, g: 1024, t: 1024 * 1024 };

/** MiB, rounded up; throws a RangeError with a readable message on anything else. */
export function parseSizeMib(value: unknown, what = "size"): number {
  let mib: number;
  if (typeof value === "number") {
    mib = value;
  } else if (typeof value === "string") {
    const m = SIZE.exec(value.trim().toLowerCase());
    if (m === null) {
      throw new RangeError(
        `${what}: bad size ${JSON.stringify(value)}; use e.g. '1GiB', '512MiB' or MiB`);
    }
    mib = Number(m[1]) * (SIZE_MIB[m[2] as string] as number);
  } else {
    throw new RangeError(
      `${what}: expected a size like '1GiB' or '512MiB', got ${JSON.stringify(value)}`);
  }
  if (!Number.isFinite(mib) || mib <= 0) {
    throw new RangeError(`${what}: must be a positive size, got ${JSON.stringify(value)}`);
  }
  return Math.ceil(mib);
}
