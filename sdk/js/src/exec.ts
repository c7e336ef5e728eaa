/** Exec output: the frames of `POST /sandboxes/{id}/exec` made into callbacks and a result. */
import { errorFrom, ServerError, Unavailable } from "./errors.js";
import { FrameDecoder, ProtocolError } from "./frames.js";
import type { ExecExitFrame } from "./models.js";
import { DEFAULT_MAX_OUTPUT, OutputBuffer, TextSplitter } from "./output.js";

/** Gets each line (or chunk) of output; a returned promise is awaited before reading on. */
export type OutputCallback = (text: string) => unknown;

const decoder = new TextDecoder();

/** What a finished command did. */
export class ExecResult {
  constructor(
    readonly exitCode: number,
    /** Raw output, at most `maxOutput` bytes per stream (head and tail if cut). */
    readonly stdoutBytes: Uint8Array,
    readonly stderrBytes: Uint8Array,
    /** Seconds, as the daemon measured. */
    readonly duration: number,
    readonly timedOut: boolean,
    readonly signal: number | null,
    /** Some output was cut (more than `maxOutput` bytes in a stream). */
    readonly truncated: boolean,
    readonly execId: string | null,
    readonly stdoutTotal: number,
    readonly stderrTotal: number,
    /** The sandbox ran out of memory while it ran (its kernel killed a process). */
    readonly oom: boolean = false,
  ) {}

  /** stdout decoded as UTF-8 (invalid bytes replaced). */
  get stdout(): string {
    return decoder.decode(this.stdoutBytes);
  }

  get stderr(): string {
    return decoder.decode(this.stderrBytes);
  }

  /** Exit code 0 and no timeout. */
  get ok(): boolean {
    return this.exitCode === 0 && !this.timedOut;
  }
}

export interface ExecOutputOptions {
  onStdout?: OutputCallback | undefined;
  onStderr?: OutputCallback | undefined;
  /** true (default): callbacks get whole lines, without the newline; false: text as it
   * arrives. */
  lines?: boolean | undefined;
  maxOutput?: number | undefined;
}

/** What output frames become: callbacks with text as it arrives (lines by default), and
 * the raw bytes kept (at most `maxOutput` per stream, head and tail). */
export class OutputSink {
  private readonly bufs: [OutputBuffer, OutputBuffer];
  private readonly text: [TextSplitter, TextSplitter];
  private readonly cbs: [OutputCallback | undefined, OutputCallback | undefined];

  constructor(opts: ExecOutputOptions = {}) {
    const cap = opts.maxOutput ?? DEFAULT_MAX_OUTPUT;
    const lines = opts.lines ?? true;
    this.bufs = [new OutputBuffer(cap), new OutputBuffer(cap)];
    this.text = [new TextSplitter(lines), new TextSplitter(lines)];
    this.cbs = [opts.onStdout, opts.onStderr];
  }

  async out(fd: 1 | 2, payload: Uint8Array): Promise<void> {
    const i = fd - 1;
    (this.bufs[i] as OutputBuffer).add(payload);
    const cb = this.cbs[i];
    if (cb) await deliver(cb, (this.text[i] as TextSplitter).feed(payload));
  }

  /** Hand on what the splitters still hold (the last line without its newline). */
  async flush(): Promise<void> {
    for (const i of [0, 1] as const) {
      const cb = this.cbs[i];
      if (cb) await deliver(cb, this.text[i].end());
    }
  }

  value(fd: 1 | 2): Uint8Array {
    return (this.bufs[fd - 1] as OutputBuffer).value();
  }

  result(x: ExecExitFrame, execId: string | null): ExecResult {
    const [out, err] = this.bufs;
    return new ExecResult(
      Number(x.exit_code), out.value(), err.value(), Number(x.duration ?? 0),
      x.timed_out === true, typeof x.signal === "number" ? x.signal : null,
      out.truncated || err.truncated, execId, out.total, err.total, x.oom === true);
  }
}

/** Consumes one exec stream's bytes (in any chunks); `finish()` gives the result. */
export class ExecStreamReader {
  private readonly dec = new FrameDecoder();
  private readonly sink: OutputSink;
  private exit: ExecExitFrame | null = null;
  private execId: string | null = null;

  constructor(opts: ExecOutputOptions = {},
              private readonly onStarted?: (execId: string) => void) {
    this.sink = new OutputSink(opts);
  }

  async feed(chunk: Uint8Array): Promise<void> {
    let frames;
    try {
      frames = this.dec.feed(chunk);
    } catch (e) {
      if (e instanceof ProtocolError) throw new ServerError(`malformed exec stream: ${e.message}`);
      throw e;
    }
    for (const { header: h, payload } of frames) {
      if (this.exit) throw new ServerError("malformed exec stream: a frame after the exit");
      if (h.t === "out" && (h.fd === 1 || h.fd === 2)) {
        await this.sink.out(h.fd, payload);
      } else if (h.t === "started") {
        this.execId = typeof h.exec_id === "string" ? h.exec_id : null;
        if (this.execId !== null) this.onStarted?.(this.execId);
      } else if (h.t === "exit") {
        this.exit = h as unknown as ExecExitFrame;
      } else if (h.t === "error") {
        throw errorFrom(undefined, typeof h.code === "string" ? h.code : undefined,
                        String(h.message));
      }
    }
  }

  async finish(): Promise<ExecResult> {
    if (this.exit === null) throw new Unavailable("exec stream ended without an exit status");
    await this.sink.flush();
    return this.sink.result(this.exit, this.execId);
  }
}

async function deliver(cb: OutputCallback, texts: string[]): Promise<void> {
  for (const t of texts) {
    const r = cb(t);
    if (r && typeof (r as PromiseLike<unknown>).then === "function") await r;
  }
}
