/**
 * `sbx.commands`: background commands, which run on after the call that started them, after
 * this client is gone and across a daemon restart; their output is kept in the sandbox (a
 * ring of `buffer` bytes) and can be read again from any offset it still holds. Mirrors the
 * Python SDK's `sbx.commands`.
 *
 * ```ts
 * const h = await sbx.exec("python -m http.server 8000", { background: true })
 * await sbx.commands.list()
 * const h2 = await sbx.commands.connect(h.pid, { onStdout: (line) => console.log(line) })
 * await h2.kill("TERM"); const result = await h2.wait()
 * ```
 */
import { Readable } from "node:stream";
import { parseDuration, type Duration } from "./durations.js";
import { errorFrom, InvalidArgument, ServerError, Unavailable } from "./errors.js";
import { ExecResult, OutputSink, type ExecOutputOptions } from "./exec.js";
import { CONTENT_TYPE, FrameDecoder, ProtocolError, type FrameHeader } from "./frames.js";
import { iterate, type HttpClient } from "./http.js";
import type { CommandInfo, CommandList, ExecExitFrame, StartCommandBody, StdinResult }
  from "./models.js";

/** What a command's stdin can be sent: bytes, text, or an (async) iterable of them. */
export type StdinSource = string | Uint8Array | Iterable<string | Uint8Array> |
  AsyncIterable<string | Uint8Array>;

export interface RunOptions extends ExecOutputOptions {
  env?: Record<string, string>;
  cwd?: string;
  /** Kill it after this long (default: none; the sandbox's life bounds it). */
  timeout?: Duration;
  /** Bytes of its output the sandbox keeps (stdout and stderr together); default 1 MiB. */
  buffer?: number;
  /** Keep a pipe to its stdin (default true; else /dev/null). */
  stdin?: boolean;
}

export interface FollowOptions extends ExecOutputOptions {
  /** The output offset to read from (default 0: the oldest the sandbox still holds). */
  offset?: number;
}

/** @internal */
export function stdinBody(data: StdinSource): { body: Uint8Array } | { stream: Readable } {
  if (typeof data === "string") return { body: new TextEncoder().encode(data) };
  if (data instanceof Uint8Array) return { body: data };
  const src = data;
  async function* bytes() {
    for await (const b of src as AsyncIterable<string | Uint8Array>) {
      if (typeof b === "string") yield Buffer.from(b);
      else if (b instanceof Uint8Array) yield Buffer.from(b.buffer, b.byteOffset, b.byteLength);
      else throw new InvalidArgument("stdin chunks must be strings or Uint8Arrays");
    }
  }
  return { stream: Readable.from(bytes(), { objectMode: false }) };
}

/** A background command: `pid`; `wait()` follows its output (from `offset`) to the
 * callbacks and resolves with its result once it exits; `kill`, `sendStdin`, `closeStdin`.
 * Any number of handles may follow one command. */
export class CommandHandle {
  readonly pid: number;
  /** Where the next read of its output starts; moves as output is read. */
  offset: number;
  private readonly out: ExecOutputOptions;

  /** @internal */
  constructor(private readonly commands: Commands, pid: number, opts: FollowOptions = {}) {
    this.pid = pid;
    this.offset = opts.offset ?? 0;
    this.out = opts;
  }

  private get base(): string {
    return `${this.commands.base}/${this.pid}`;
  }

  async info(): Promise<CommandInfo> {
    return this.commands.http.request<CommandInfo>("GET", this.base);
  }

  /** Follow its output to the end (the callbacks get it as it comes) and resolve with its
   * result: exit status and the output kept (from `offset`). Rejects with `Unavailable` if
   * the sandbox stops answering; calling `wait` again goes on where it was. Aborting
   * `signal` stops following; the command runs on. */
  async wait(opts: { signal?: AbortSignal } = {}): Promise<ExecResult> {
    const sink = new OutputSink(this.out);
    const end = await this.follow(sink, true, opts.signal);
    await sink.flush();
    return sink.result(end as unknown as ExecExitFrame, null);
  }

  /** What it has written from `offset` up to now, without waiting; `offset` moves past it. */
  async output(): Promise<{ stdout: Uint8Array; stderr: Uint8Array }> {
    const sink = new OutputSink({ maxOutput: this.out.maxOutput });
    await this.follow(sink, false);
    return { stdout: sink.value(1), stderr: sink.value(2) };
  }

  private async follow(sink: OutputSink, follow: boolean, signal?: AbortSignal):
      Promise<FrameHeader> {
    const what = `output of command ${this.pid}`;
    const res = await this.commands.http.open("GET", `${this.base}/output`, {
      query: { offset: this.offset, follow }, headers: { Accept: CONTENT_TYPE }, signal,
    });
    const dec = new FrameDecoder();
    let end: FrameHeader | null = null;
    try {
      for await (const chunk of iterate(res, what, signal)) {
        for (const { header: h, payload } of dec.feed(chunk)) {
          if (h.t === "out" && (h.fd === 1 || h.fd === 2)) {
            await sink.out(h.fd, payload);
            this.offset = Number(h.off ?? 0) + payload.length;
          } else if (h.t === "attached") {
            this.offset = Math.max(this.offset, Number(h.offset ?? 0));
          } else if (h.t === "exit" || h.t === "eof") {
            end = h;
            this.offset = Number(h.next ?? this.offset);
          } else if (h.t === "error") {
            throw errorFrom(undefined, typeof h.code === "string" ? h.code : undefined,
                            String(h.message), { pid: this.pid, offset: this.offset });
          }
        }
      }
    } catch (e) {
      if (e instanceof ProtocolError) throw new ServerError(`malformed ${what}: ${e.message}`);
      throw e;
    } finally {
      res.destroy();
    }
    if (end === null) {
      throw new Unavailable(`the ${what} ended before its end`,
                            { details: { pid: this.pid, offset: this.offset } });
    }
    return end;
  }

  /** Send it a signal (default KILL: its whole process tree ends). */
  async kill(signal: string | number = "KILL"): Promise<CommandInfo> {
    return this.commands.http.request<CommandInfo>("POST", `${this.base}/signal`,
                                                   { json: { signal } });
  }

  /** Write to its stdin (streamed no faster than the command reads); the byte count. */
  async sendStdin(data: StdinSource): Promise<number> {
    const d = await this.commands.http.request<StdinResult>("POST", `${this.base}/stdin`,
                                                            stdinBody(data));
    return d.written;
  }

  async closeStdin(): Promise<void> {
    await this.commands.http.request("POST", `${this.base}/stdin`,
                                     { query: { close: true }, body: new Uint8Array() });
  }
}

/** `sbx.commands`: the sandbox's background commands. */
export class Commands {
  /** @internal */
  constructor(readonly http: HttpClient, private readonly sandboxId: string) {}

  /** @internal */
  get base(): string {
    return `/sandboxes/${encodeURIComponent(this.sandboxId)}/commands`;
  }

  /** Start `cmd` in the background (as `sbx.exec(cmd, { background: true })`). */
  async run(cmd: string | string[], opts: RunOptions = {}): Promise<CommandHandle> {
    let timeout: number | null = null;
    if (opts.timeout !== undefined) {
      try {
        timeout = parseDuration(opts.timeout, "timeout");
      } catch (e) {
        throw new InvalidArgument((e as Error).message);
      }
    }
    const body: StartCommandBody = { cmd, env: opts.env ?? {}, cwd: opts.cwd ?? null, timeout,
                                      stdin: opts.stdin ?? true };
    if (opts.buffer !== undefined) body.buffer = opts.buffer;
    const d = await this.http.request<CommandInfo>("POST", this.base, { json: body });
    return new CommandHandle(this, d.pid, opts);
  }

  async list(): Promise<CommandInfo[]> {
    return (await this.http.request<CommandList>("GET", this.base)).commands;
  }

  /** A handle on a background command started by anyone (another client, before a daemon
   * restart); `wait()` on it follows its output from `offset`. NotFound if there is none. */
  async connect(pid: number, opts: FollowOptions = {}): Promise<CommandHandle> {
    await this.http.request("GET", `${this.base}/${pid}`);
    return new CommandHandle(this, pid, opts);
  }

  async kill(pid: number, signal: string | number = "KILL"): Promise<CommandInfo> {
    return new CommandHandle(this, pid).kill(signal);
  }

  async sendStdin(pid: number, data: StdinSource): Promise<number> {
    return new CommandHandle(this, pid).sendStdin(data);
  }

  async closeStdin(pid: number): Promise<void> {
    await new CommandHandle(this, pid).closeStdin();
  }
}

