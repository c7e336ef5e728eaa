/** The one I/O boundary: HTTP to the daemon (node:http), errors mapped to the CpuosError tree. */
import http from "node:http";
import https from "node:https";
import type { IncomingMessage } from "node:http";
import type { Readable } from "node:stream";
import { resolveConfig, type ConnectionOptions } from "./config.js";
import { errorFrom, ServerError, Timeout, Unavailable } from "./errors.js";

/** How long to try to connect to the daemon before giving up. */
const CONNECT_TIMEOUT_MS = 60_000;
/** An error answer's body is read up to this much. */
const MAX_ERROR_BODY = 1 << 20;
/** A JSON answer's body is read up to this much. */
const MAX_JSON_BODY = 64 << 20;

// Idle keep-alive sockets are closed after 2 s, before the daemon's 5 s (uvicorn) would.
const agents = {
  "http:": new http.Agent({ keepAlive: true, timeout: 2_000 }),
  "https:": new https.Agent({ keepAlive: true, timeout: 2_000 }),
};

export type Query = Record<string, string | number | boolean | undefined>;

export interface RequestOptions {
  query?: Query;
  json?: unknown;
  body?: Uint8Array;
  /** A body of unknown length, sent chunked as it is read (never retried). */
  stream?: Readable;
  headers?: Record<string, string>;
  signal?: AbortSignal | undefined;
}

export class HttpClient {
  readonly url: string;
  readonly key: string;

  constructor(opts: ConnectionOptions = {}) {
    const { url, key } = resolveConfig(opts);
    this.url = url;
    this.key = key;
  }

  /** A JSON request; the parsed JSON answer. */
  async request<T>(method: string, path: string, opts: RequestOptions = {}): Promise<T> {
    const res = await this.open(method, path, opts);
    const body = await readBody(res, MAX_JSON_BODY, `${method} ${path}`, opts.signal);
    try {
      return JSON.parse(new TextDecoder().decode(body)) as T;
    } catch {
      throw new ServerError(`${method} ${path}: the answer is not JSON`, { status: res.statusCode });
    }
  }

  /** The response, once its status is known to be a success; its body is the caller's. */
  async open(method: string, path: string, opts: RequestOptions = {}): Promise<IncomingMessage> {
    const replayable = opts.stream === undefined;
    for (let attempt = 0; ; attempt++) {
      try {
        const res = await this.send(method, path, opts, attempt > 0);
        const status = res.statusCode ?? 0;
        if (status >= 400) throw await errorOf(res, `${method} ${path}`, opts.signal);
        return res;
      } catch (e) {
        // A kept-alive connection reset before any answer, on reuse: the daemon had closed
        // it as idle (a busy event loop here may not have seen that yet) and dropped the
        // request unread, so it is sent once more on a new connection, a POST too. (A
        // daemon that died mid-request is not there to take it again: that is Unavailable.)
        // The retry has a connection of its own: the pool may hold more such.
        if (replayable && attempt === 0 && (e as { reusedSocket?: boolean }).reusedSocket) {
          continue;
        }
        throw e;
      }
    }
  }

  private send(method: string, path: string, opts: RequestOptions, fresh = false):
      Promise<IncomingMessage> {
    const url = new URL(this.url + path);
    for (const [k, v] of Object.entries(opts.query ?? {})) {
      if (v !== undefined) url.searchParams.set(k, String(v));
    }
    const headers: Record<string, string> = {
      Authorization: `Bearer ${this.key}`, ...opts.headers,
    };
    let body: Uint8Array | undefined;
    if (opts.json !== undefined) {
      body = new TextEncoder().encode(JSON.stringify(opts.json));
      headers["Content-Type"] = "application/json";
    } else if (opts.body !== undefined) {
      body = opts.body;
      headers["Content-Type"] = "application/octet-stream";
    } else if (opts.stream !== undefined) {
      headers["Content-Type"] = "application/octet-stream";
    }
    if (body !== undefined) headers["Content-Length"] = String(body.length);
    const signal = opts.signal;
    const mod = url.protocol === "https:" ? https : http;
    // A streamed upload has a connection of its own, closed after it: answered before
    // the upload ended, its last write may fail (the daemon reset the connection) once the
    // answer is in, and a kept-alive socket has no error listener on its way back to the
    // pool (Node's responseKeepAlive): that error would be uncaught.
    const agent = fresh || opts.stream !== undefined ? false
      : agents[url.protocol as "http:" | "https:"];
    return new Promise<IncomingMessage>((resolve, reject) => {
      signal?.throwIfAborted();
      const req = mod.request(url, { method, headers, agent, signal });
      let connectTimer: NodeJS.Timeout | undefined;
      let localError: Error | undefined;
      req.on("socket", (sock) => {
        // (its own connection: a write failing after the answer is no one's error)
        if (opts.stream !== undefined) sock.on("error", () => undefined);
        if (!sock.connecting) return;
        connectTimer = setTimeout(() => req.destroy(new Timeout(
          `${method} ${path}: could not connect to cpuosd at ${this.url} in ` +
          `${CONNECT_TIMEOUT_MS / 1000}s`)), CONNECT_TIMEOUT_MS);
        sock.once("connect", () => clearTimeout(connectTimer));
      });
      req.on("response", (res) => {
        clearTimeout(connectTimer);
        const src = opts.stream;
        if (src !== undefined && !src.readableEnded) {
          // answered before the upload ended (a command's stdin closed, an error): the
          // rest is not wanted; stop reading the source and end the request cleanly
          src.unpipe(req);
          src.destroy();
          req.end();
        }
        resolve(res);
      });
      req.on("error", (e: Error & { code?: string }) => {
        clearTimeout(connectTimer);
        if (signal?.aborted) return reject(signal.reason);
        if (e instanceof Timeout) return reject(e);
        if (localError !== undefined) return reject(localError);
        const err = new Unavailable(`cannot reach cpuosd at ${this.url}: ${e.message}`,
                                    { cause: e });
        if (req.reusedSocket && (e.code === "ECONNRESET" || e.code === "EPIPE")) {
          (err as { reusedSocket?: boolean }).reusedSocket = true;
        }
        reject(err);
      });
      const source = opts.stream;
      if (source === undefined) {
        req.end(body);
        return;
      }
      source.on("error", (e) => {  // a local read failed: the upload is cut, that error given
        localError = e;
        req.destroy(e);
      });
      source.pipe(req);
    });
  }
}

/** A response body, whole (at most `max` bytes). A body cut short raises Unavailable. */
export async function readBody(res: IncomingMessage, max: number, what: string,
                               signal?: AbortSignal): Promise<Uint8Array> {
  const parts: Buffer[] = [];
  let n = 0;
  for await (const chunk of iterate(res, what, signal)) {
    n += chunk.length;
    if (n > max) {
      res.destroy();
      throw new ServerError(`${what}: the answer is larger than ${max} bytes`);
    }
    parts.push(chunk);
  }
  return Buffer.concat(parts);
}

/** The body's chunks as they arrive; a body cut short (the connection ended before its
 * Content-Length or its chunked end) raises Unavailable, an abort the signal's reason. */
export async function* iterate(res: IncomingMessage, what: string, signal?: AbortSignal):
    AsyncGenerator<Buffer> {
  try {
    for await (const chunk of res) yield chunk as Buffer;
  } catch (e) {
    if (signal?.aborted) throw signal.reason;
    throw new Unavailable(`${what}: the connection to cpuosd broke: ${(e as Error).message}`,
                          { cause: e });
  }
  if (!res.complete) {
    if (signal?.aborted) throw signal.reason;
    throw new Unavailable(`${what}: the connection to cpuosd broke mid-answer`);
  }
}

async function errorOf(res: IncomingMessage, what: string, signal?: AbortSignal):
    Promise<Error> {
  const status = res.statusCode ?? 0;
  let body: Uint8Array;
  try {
    body = await readBody(res, MAX_ERROR_BODY, what, signal);
  } catch (e) {
    return e as Error;
  }
  const text = new TextDecoder().decode(body);
  try {
    const err = (JSON.parse(text) as { error?: { code?: string; message?: string;
                                                 details?: Record<string, unknown> } }).error;
    if (err && typeof err === "object") {
      return errorFrom(status, err.code, String(err.message ?? `HTTP ${status}`),
                       err.details ?? undefined);
    }
  } catch { /* not JSON */ }
  return errorFrom(status, undefined, text.slice(0, 500) || `HTTP ${status}`);
}
