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
