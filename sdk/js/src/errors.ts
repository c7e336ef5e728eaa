/**
 * The SDK's error tree, as in the Python SDK (cpuos/_errors.py). Every failure is a
 * `CpuosError`:
 *
 * ```
 * CpuosError
 * ├── AuthError            401: missing or wrong API key
 * ├── PermissionDenied     403: the key or the sandbox user may not do this
 * ├── NotFound             404: no such sandbox / template / file (for this key)
 * ├── Conflict             409: wrong state (e.g. exec on a killed sandbox), exists, is a dir
 * ├── InvalidArgument      422: bad input (path, duration, command...)
 * ├── LimitExceeded        429
 * ├── NoSpace              507: the sandbox's disk is full
 * ├── Timeout              504 / client-side timeout
 * ├── Unavailable          503: daemon or sandbox agent unreachable
 * └── ServerError          5xx / malformed answers
 * ```
 */

import { ERROR_TABLE } from "./generated/error-codes.js";

export interface ErrorOptions {
  code?: string | undefined;
  status?: number | undefined;
  details?: Record<string, unknown> | undefined;
  cause?: unknown;
}

export class CpuosError extends Error {
  static readonly defaultCode: string = "internal";
  /** The API's error code (e.g. `not_found`, `is_a_directory`). */
  readonly code: string;
  /** The HTTP status, when the error came in an HTTP answer. */
  readonly status: number | undefined;
  readonly details: Record<string, unknown>;

  constructor(message: string, options: ErrorOptions = {}) {
    super(message, options.cause === undefined ? undefined : { cause: options.cause });
    this.name = new.target.name;
    this.code = options.code ?? (new.target as typeof CpuosError).defaultCode;
    this.status = options.status;
    this.details = options.details ?? {};
  }
}

export class AuthError extends CpuosError { static override readonly defaultCode = "unauthorized"; }
export class PermissionDenied extends CpuosError {
  static override readonly defaultCode = "permission_denied";
}
export class NotFound extends CpuosError { static override readonly defaultCode = "not_found"; }
export class Conflict extends CpuosError { static override readonly defaultCode = "conflict"; }
export class InvalidArgument extends CpuosError {
  static override readonly defaultCode = "invalid_argument";
}
export class LimitExceeded extends CpuosError {
  static override readonly defaultCode = "limit_exceeded";
}
export class NoSpace extends CpuosError { static override readonly defaultCode = "no_space"; }
export class Timeout extends CpuosError { static override readonly defaultCode = "timeout"; }
export class Unavailable extends CpuosError { static override readonly defaultCode = "unavailable"; }
export class ServerError extends CpuosError { static override readonly defaultCode = "internal"; }

type ErrorClass = new (message: string, options?: ErrorOptions) => CpuosError;

// every class the daemon's table names must be one here (else this does not compile)
const CLASSES: Record<(typeof ERROR_TABLE)[keyof typeof ERROR_TABLE]["class"], ErrorClass> = {
  AuthError, PermissionDenied, NotFound, Conflict, InvalidArgument, LimitExceeded, NoSpace,
  Timeout, Unavailable, ServerError,
};

/**
 * The error codes: code -> [HTTP status, class], from the one table
 * (cpuos._errors.ERROR_CODES, generated into ./generated/error-codes.ts).
 */
export const ERROR_CODES: Readonly<Record<string, readonly [number, ErrorClass]>> =
  Object.fromEntries(Object.entries(ERROR_TABLE).map(
    ([code, { status, class: cls }]) => [code, [status, CLASSES[cls]] as const]));

const BY_STATUS = new Map<number, ErrorClass>();
for (const [status, cls] of Object.values(ERROR_CODES)) {
  if (status !== 500 && !BY_STATUS.has(status)) BY_STATUS.set(status, cls);
}

/** The error for an API answer: by its code, else its HTTP status, else ServerError. */
export function errorFrom(status: number | undefined, code: string | undefined | null,
                          message: string, details?: Record<string, unknown>): CpuosError {
  const byCode = code && Object.hasOwn(ERROR_CODES, code) ? ERROR_CODES[code]?.[1] : undefined;
  const cls = byCode ?? (status === undefined ? undefined : BY_STATUS.get(status)) ?? ServerError;
  return new cls(message, { code: code ?? undefined, status, details });
}
