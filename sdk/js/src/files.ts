/** `sbx.files`: files inside the sandbox. Relative paths are relative to /work. */
import { createReadStream, createWriteStream } from "node:fs";
import { rm } from "node:fs/promises";
import { pipeline } from "node:stream/promises";
import { CpuosError, errorFrom, InvalidArgument, ServerError, Unavailable } from "./errors.js";
import { CONTENT_TYPE, FrameDecoder, ProtocolError } from "./frames.js";
import type { HttpClient } from "./http.js";
import { iterate } from "./http.js";
import type { FileEntry, FileList } from "./models.js";
import { concat } from "./output.js";

export interface CallOptions {
  /** Cancels the call (the promise rejects with the signal's reason). */
  signal?: AbortSignal;
}

/** What `read` accepts by default (it holds the file in memory): 1 GiB. */
export const READ_MAX_BYTES = 1024 ** 3;
/** What `download` accepts by default (it writes to this host's disk): 8 GiB. */
export const DOWNLOAD_MAX_BYTES = 8 * 1024 ** 3;

export interface ReadOptions extends CallOptions {
  /** The most bytes accepted: a file declaring more is refused before its body, a stream
   * passing it is cut; either way an `InvalidArgument` with code `too_large`. `null`: no
   * limit here (the daemon's `CPUOS_MAX_READ_BYTES` still holds). Defaults: `read`
   * `READ_MAX_BYTES`, `download` `DOWNLOAD_MAX_BYTES`, `chunks` none. */
  maxBytes?: number | null;
}

function tooLarge(path: string, limit: number): CpuosError {
  return errorFrom(413, "too_large", `${path}: more than ${limit} bytes; pass maxBytes to ` +
                   "accept more (null: no limit)", { path, limit });
}

export class Files {
  /** @internal */
  constructor(private readonly http: HttpClient, private readonly sandboxId: string) {}

  private get base(): string {
    return `/sandboxes/${encodeURIComponent(this.sandboxId)}/files`;
  }

  /** Create or replace a file (parents are created); atomic inside the sandbox. A string is
   * written as UTF-8. */
  async write(path: string, data: string | Uint8Array, opts: CallOptions = {}):
      Promise<FileEntry> {
    let body: Uint8Array;
    if (typeof data === "string") body = new TextEncoder().encode(data);
    else if (data instanceof Uint8Array) body = data;
    else throw new InvalidArgument("data must be a string or a Uint8Array");
    return this.http.request<FileEntry>("PUT", this.base, { query: { path }, body, ...opts });
  }

  /** The file's bytes. Rejects (a CpuosError) if the read fails, also part-way: the daemon
   * ends a failed read with an `error` frame, or the stream lacks its `eof`. */
  async read(path: string, opts: ReadOptions = {}): Promise<Uint8Array> {
    const parts: Uint8Array[] = [];
    const maxBytes = opts.maxBytes === undefined ? READ_MAX_BYTES : opts.maxBytes;
    for await (const chunk of this.chunks(path, { ...opts, maxBytes })) parts.push(chunk);
    return concat(parts);
  }

  /** The file's bytes as they arrive, without holding it whole; a read that fails part-way
   * throws (a CpuosError), as does one passing `maxBytes` (no limit by default). */
  async *chunks(path: string, opts: ReadOptions = {}): AsyncGenerator<Uint8Array> {
    const what = `reading ${path}`;
    const max = opts.maxBytes ?? undefined;
    if (max !== undefined && !(Number.isSafeInteger(max) && max >= 0)) {
      throw new InvalidArgument("maxBytes must be an integer >= 0 (or null: no limit)");
    }
    const res = await this.http.open("GET", this.base, {
      query: { path, max_bytes: max }, headers: { Accept: CONTENT_TYPE }, signal: opts.signal,
    });
    let got = 0;
    if (!String(res.headers["content-type"] ?? "").startsWith(CONTENT_TYPE)) {
      try {  // raw bytes (a daemon without framed reads)
        for await (const chunk of iterate(res, what, opts.signal)) {
          got += chunk.length;
          if (max !== undefined && got > max) throw tooLarge(path, max);
          yield chunk;
        }
      } finally {
        res.destroy();
      }
      return;
    }
    const dec = new FrameDecoder();
    let ended = false;
    try {
      for await (const chunk of iterate(res, what, opts.signal)) {
        for (const { header: h, payload } of dec.feed(chunk)) {
          if (ended) throw new ServerError(`${what}: data after the end of the stream`);
          if (h.t === "data") {
            got += payload.length;
            if (max !== undefined && got > max) throw tooLarge(path, max);
            yield payload;
          } else if (h.t === "eof") {
            if (h.size !== got) {
              throw new ServerError(`${what}: ${got} bytes received, the stream says ` +
                                    `${JSON.stringify(h.size)}`);
            }
            ended = true;
          } else if (h.t === "error") {
            throw errorFrom(undefined, typeof h.code === "string" ? h.code : undefined,
                            `${what} failed after ${got} bytes: ${String(h.message)}`,
                            { path, received: got });
          }
        }
      }
    } catch (e) {
      if (e instanceof ProtocolError) throw new ServerError(`${what}: malformed stream: ${e.message}`);
      throw e;
    } finally {
      res.destroy();  // a no-op after a whole body; else the daemon stops reading
    }
    if (!ended) {
      throw new Unavailable(`${what}: the stream ended after ${got} bytes without its end`,
                            { details: { path, received: got } });
    }
  }

  /** Stream a local file into the sandbox without holding it in memory. */
  async upload(localPath: string, path: string, opts: CallOptions = {}): Promise<FileEntry> {
    return this.http.request<FileEntry>("PUT", this.base, {
      query: { path }, stream: createReadStream(localPath), ...opts,
    });
  }

  /** Stream a sandbox file to a local file; the byte count. A read that fails part-way
   * rejects, and the partial local file is removed; so does one over `maxBytes` (default
   * `DOWNLOAD_MAX_BYTES`: `InvalidArgument`, code `too_large`). */
  async download(path: string, localPath: string, opts: ReadOptions = {}): Promise<number> {
    let n = 0;
    const counted = async function* (src: AsyncIterable<Uint8Array>) {
      for await (const c of src) {
        n += c.length;
        yield c;
      }
    };
    try {
      const maxBytes = opts.maxBytes === undefined ? DOWNLOAD_MAX_BYTES : opts.maxBytes;
      await pipeline(counted(this.chunks(path, { ...opts, maxBytes })),
                     createWriteStream(localPath));
    } catch (e) {
      await rm(localPath, { force: true });
      throw e;
    }
    return n;
  }

  /** The file as text (UTF-8 by default). */
  async readText(path: string, opts: ReadOptions & { encoding?: string } = {}): Promise<string> {
    return new TextDecoder(opts.encoding ?? "utf-8").decode(await this.read(path, opts));
  }

  async list(path = "/work", opts: CallOptions = {}): Promise<FileEntry[]> {
    const d = await this.http.request<FileList>("GET", this.base + "/list",
                                                { query: { path }, ...opts });
    return d.entries;
  }

  async stat(path: string, opts: CallOptions = {}): Promise<FileEntry> {
    return this.http.request<FileEntry>("GET", this.base + "/stat", { query: { path }, ...opts });
  }

  async exists(path: string, opts: CallOptions = {}): Promise<boolean> {
    try {
      await this.stat(path, opts);
    } catch (e) {
      if (e instanceof CpuosError && e.code === "not_found") return false;
      throw e;
    }
    return true;
  }

  /** Remove a file, or a directory with everything in it. */
  async remove(path: string, opts: CallOptions = {}): Promise<void> {
    await this.http.request("DELETE", this.base, { query: { path }, ...opts });
  }

  async mkdir(path: string, opts: CallOptions = {}): Promise<FileEntry> {
    return this.http.request<FileEntry>("POST", this.base + "/mkdir", { query: { path }, ...opts });
  }
}
