/** `Sandbox`: a disposable, isolated Linux machine. Mirrors the Python SDK's AsyncSandbox. */
import type { IncomingMessage } from "node:http";
import type { ConnectionOptions } from "./config.js";
import { parseDuration, parseSizeMib, type Duration, type Size } from "./durations.js";
import { Conflict, CpuosError, InvalidArgument, NotFound, Unavailable } from "./errors.js";
import { ExecStreamReader, type ExecResult, type OutputCallback } from "./exec.js";
import { Commands, CommandHandle, stdinBody, type StdinSource } from "./commands.js";
import { Files } from "./files.js";
import { CONTENT_TYPE } from "./frames.js";
import { HttpClient, iterate } from "./http.js";
import type { CreateSandboxBody, ExecBody, NetworkPolicy, SandboxInfo, SandboxList }
  from "./models.js";
import { Ports } from "./ports.js";

export interface CreateOptions extends ConnectionOptions {
  /** Default "python". */
  template?: string;
  /** Its wall-clock life: "15m", "1h", or seconds; default "5m". */
  timeout?: Duration;
  metadata?: Record<string, string>;
  env?: Record<string, string>;
  /** vCPUs (`vcpus` is the same). */
  cpus?: number;
  vcpus?: number;
  /** Memory: "1GiB", "512MiB" or MiB (`memoryMib` takes MiB). */
  memory?: Size;
  memoryMib?: number;
  /** Its root filesystem's writable layer: "10GiB" or MiB; past it a write inside gets
   * ENOSPC. */
  disk?: Size;
  /** Processes and threads its commands may have. Unset limits take the workspace's. */
  pids?: number;
  /** "pause" pauses it at its deadline instead of killing it. */
  onTimeout?: "kill" | "pause";
  /** Pause it after this long idle ("5m"; 0: never; default: the workspace's, 10 minutes
   * unless set): no call needing the machine, no open stream or preview connection, no CPU
   * use inside. Any such call (exec, files, commands, ...) or a preview request resumes it. */
  idleTimeout?: Duration;
  /** "off" | "on" | "allowlist" | { allow: ["pypi.org", "*.github.com"] } (default: the
   * daemon's). */
  network?: NetworkPolicy;
  /** { NAME: { value, hosts: ["api.example.com"] } }: NAME inside is a placeholder; the value
   * goes only into request headers to those hosts. */
  secrets?: Record<string, { value: string; hosts: string[] }>;
  /** A request to an exposed port of the paused sandbox resumes it (default true). */
  wakeOnRequest?: boolean;
  signal?: AbortSignal;
}

export interface ExecOptions {
  background?: false;
  /** Kills the command's whole process tree after this long (exit 137, `timedOut`). */
  timeout?: Duration;
  env?: Record<string, string>;
  /** Default: the template's workdir (/work). */
  cwd?: string;
  /** Text or bytes; or an (async) iterable of them, streamed while the command runs (no
   * faster than it reads) and then closed: the command may answer one line before the
   * next is produced. */
  stdin?: StdinSource;
  /** Each line of stdout, without its newline (or, with `lines: false`, text as it comes). */
  onStdout?: OutputCallback;
  onStderr?: OutputCallback;
  /** false: callbacks get the output as it arrives, not split into lines. Default true. */
  lines?: boolean;
  /** Bytes of each stream kept in the result (head and tail); default 16 MiB. */
  maxOutput?: number;
  /** Aborting it ends the exec: the command is killed inside, the promise rejects with the
   * signal's reason. */
  signal?: AbortSignal;
}

/** `sbx.exec(cmd, { background: true, ... })`: see `sbx.commands`. */
export interface BackgroundExecOptions {
  background: true;
  timeout?: Duration;
  env?: Record<string, string>;
  cwd?: string;
  /** Sent to its stdin once it started (which stays open: `closeStdin()`). */
  stdin?: StdinSource;
  /** Callbacks for `wait()` on the handle. */
  onStdout?: OutputCallback;
  onStderr?: OutputCallback;
  lines?: boolean;
  maxOutput?: number;
  /** Bytes of its output the sandbox keeps (stdout and stderr together); default 1 MiB. */
  buffer?: number;
}

function mib(value: Size, what: string): number {
  try {
    return parseSizeMib(value, what);
  } catch (e) {
    throw new InvalidArgument((e as Error).message);
  }
}

function seconds(value: Duration | undefined, what: string): number | undefined {
  if (value === undefined) return undefined;
  try {
    return parseDuration(value, what);
  } catch (e) {
    throw new InvalidArgument((e as Error).message);
  }
}

export class Sandbox {
  readonly id: string;
  readonly files: Files;
  readonly ports: Ports;
  readonly network: Network;
  readonly commands: Commands;
  /** @internal */
  _info: SandboxInfo;
  /** @internal */
  readonly _http: HttpClient;

  /** @internal use Sandbox.create / connect / resume */
  constructor(info: SandboxInfo, http: HttpClient) {
    this.id = info.id;
    this._info = info;
    this._http = http;
    this.files = new Files(http, info.id);
    this.ports = new Ports(http, info.id);
    this.network = new Network(this);
    this.commands = new Commands(http, info.id);
  }

  private get path(): string {
    return `/sandboxes/${encodeURIComponent(this.id)}`;
  }

  // ---- construction ------------------------------------------------------------------
  /** A new sandbox. */
  static async create(opts: CreateOptions = {}): Promise<Sandbox> {
    const http = new HttpClient(opts);
    const body: CreateSandboxBody = {
      template: opts.template ?? "python", timeout: opts.timeout ?? "5m",
      metadata: opts.metadata ?? {}, env: opts.env ?? {}, on_timeout: opts.onTimeout ?? "kill",
    };
    const vcpus = opts.cpus ?? opts.vcpus;
    if (vcpus !== undefined) body.vcpus = vcpus;
    const memory = opts.memory === undefined ? opts.memoryMib : mib(opts.memory, "memory");
    if (memory !== undefined) body.memory_mib = memory;
    if (opts.disk !== undefined) body.disk_mib = mib(opts.disk, "disk");
    if (opts.pids !== undefined) body.pids = opts.pids;
    if (opts.network !== undefined) body.network = opts.network;
    if (opts.secrets !== undefined) body.secrets = opts.secrets;
    if (opts.wakeOnRequest !== undefined) body.wake_on_request = opts.wakeOnRequest;
    if (opts.idleTimeout !== undefined) body.idle_timeout = opts.idleTimeout;
    const info = await http.request<SandboxInfo>("POST", "/sandboxes",
                                                 { json: body, signal: opts.signal });
    return new Sandbox(info, http);
  }

  /** Attach to an existing sandbox; a paused one is resumed unless `autoResume` is false. */
  static async connect(id: string, opts: ConnectionOptions & { autoResume?: boolean } = {}):
      Promise<Sandbox> {
    const http = new HttpClient(opts);
    const sbx = new Sandbox(
      await http.request<SandboxInfo>("GET", `/sandboxes/${encodeURIComponent(id)}`), http);
    if ((opts.autoResume ?? true) && sbx._info.state === "paused") {
      sbx._info = await http.request<SandboxInfo>("POST", `${sbx.path}/resume`);
    }
    return sbx;
  }

  /** Restore a paused sandbox: its processes, memory and files as they were. */
  static async resume(id: string, opts: ConnectionOptions = {}): Promise<Sandbox> {
    const http = new HttpClient(opts);
    return new Sandbox(
      await http.request<SandboxInfo>("POST", `/sandboxes/${encodeURIComponent(id)}/resume`),
      http);
  }

  /** This key's sandboxes: the live ones, or with `all` the ended ones too. */
  static async list(opts: ConnectionOptions & { all?: boolean } = {}): Promise<SandboxInfo[]> {
    const http = new HttpClient(opts);
    const d = await http.request<SandboxList>("GET", "/sandboxes",
                                              { query: { all: opts.all ?? false } });
    return d.sandboxes;
  }

  // ---- lifecycle ---------------------------------------------------------------------
  /** The sandbox as the daemon sees it now. */
  async info(): Promise<SandboxInfo> {
    this._info = await this._http.request<SandboxInfo>("GET", this.path);
    return this._info;
  }

  /** What the host measures of the sandbox now: cpu_seconds, cpu_percent_avg, memory_bytes,
   * memory_limit_bytes, pids, pids_limit, net_tx_bytes, net_rx_bytes (those it can). */
  async metrics(): Promise<Record<string, unknown>> {
    return this._http.request<Record<string, unknown>>("GET", `${this.path}/metrics`);
  }

  /** The host-form preview URL of `port` (`http://<port>-<id>.localhost:...`), exposing it
   * if needed: the port's own origin, the form browsers are served; send its token as
   * `X-Cpuos-Token`, or once as `?cpuos_token=` from a browser (a cookie of that host from
   * then on). */
  async getHost(port: number): Promise<string> {
    return (await this.ports.info(port)).host_url;
  }

  /** Kill the sandbox `timeout` from now (extends or shortens its life). */
  async setTimeout(timeout: Duration): Promise<SandboxInfo> {
    this._info = await this._http.request<SandboxInfo>("POST", `${this.path}/timeout`,
                                                       { json: { timeout } });
    return this._info;
  }

  /** Pause the sandbox after `idleTimeout` idle, counted from now (0: never). */
  async setIdleTimeout(idleTimeout: Duration): Promise<SandboxInfo> {
    this._info = await this._http.request<SandboxInfo>("POST", `${this.path}/timeout`,
                                                       { json: { idle_timeout: idleTimeout } });
    return this._info;
  }

  /** Checkpoint the sandbox to disk and stop it (CPU and memory are freed); returns its id
   * for `Sandbox.resume(id)`. */
  async pause(): Promise<string> {
    this._info = await this._http.request<SandboxInfo>("POST", `${this.path}/pause`);
    return this.id;
  }

  /** `n` new sandboxes with this one's memory, processes and files. */
  async fork(n = 1): Promise<Sandbox[]> {
    const d = await this._http.request<SandboxList>("POST", `${this.path}/fork`,
                                                    { json: { n } });
    return d.sandboxes.map((x) => new Sandbox(x, this._http));
  }

  /** Kill the sandbox (one that is already gone is no error). */
  async kill(): Promise<void> {
    try {
      await this._http.request("DELETE", this.path);
    } catch (e) {
      if (!(e instanceof CpuosError && e.code === "not_found")) throw e;
    }
  }

  /** `await using sbx = await Sandbox.create()` kills it at the end of the block. */
  async [Symbol.asyncDispose](): Promise<void> {
    await this.kill();
  }

  // ---- exec --------------------------------------------------------------------------
  /**
   * Run `cmd` (a shell line for bash, or an argv array) and wait for it.
   *
   * Output streams to `onStdout` / `onStderr` as it arrives, a line at a time (UTF-8,
   * invalid bytes replaced); the result keeps raw bytes, at most `maxOutput` per stream. A
   * timeout kills the command's whole process tree and sets `timedOut` (exit code 137).
   */
  exec(cmd: string | string[], opts?: ExecOptions & { background?: false }): Promise<ExecResult>;
  /** `background: true`: start it and resolve at once with a handle (`pid`, `wait`, `kill`,
   * `sendStdin`, `closeStdin`); it runs on after this client is gone (see `sbx.commands`).
   * `buffer`: bytes of its output the sandbox keeps; `stdin` is sent to it. */
  exec(cmd: string | string[], opts: BackgroundExecOptions): Promise<CommandHandle>;
  async exec(cmd: string | string[], opts: ExecOptions | BackgroundExecOptions = {}):
      Promise<ExecResult | CommandHandle> {
    if ("background" in opts && opts.background) {
      const { stdin, ...rest } = opts;
      const h = await this.commands.run(cmd, rest);
      if (stdin !== undefined) await h.sendStdin(stdin);
      return h;
    }
    const stdin = opts.stdin;
    const streamed = stdin !== undefined && typeof stdin !== "string" &&
      !(stdin instanceof Uint8Array);
    const body: ExecBody = { cmd, env: opts.env ?? {}, cwd: opts.cwd ?? null,
                             timeout: seconds(opts.timeout, "timeout") ?? null };
    if (typeof stdin === "string") body.stdin = stdin;
    else if (stdin instanceof Uint8Array) body.stdin_b64 = Buffer.from(stdin).toString("base64");
    else if (streamed) body.stdin_stream = true;
    const signal = opts.signal;
    // a streamed stdin goes in a request of its own, beside the output, once the exec has
    // an id; it ends with the exec at the latest
    const pumpStop = new AbortController();
    const stopPump = () => pumpStop.abort();
    signal?.addEventListener("abort", stopPump, { once: true });
    let pump: Promise<void> | undefined;
    let pumpError: unknown;
    let res: IncomingMessage | undefined;
    const reader = new ExecStreamReader(opts, (execId) => {
      if (!streamed || pump !== undefined) return;
      pump = this._http.request(
        "POST", `${this.path}/execs/${encodeURIComponent(execId)}/stdin`,
        { query: { close: true }, ...stdinBody(stdin as StdinSource), signal: pumpStop.signal },
      ).then(() => undefined, (e: unknown) => {
        // the command stopped reading (it exited, closed its stdin), or the exec is over:
        // the rest is not sent, and that is no error of the exec's
        if (pumpStop.signal.aborted || e instanceof InvalidArgument || e instanceof NotFound ||
            e instanceof Conflict) return;
        // the daemon closed the upload's connection while its body was still being sent:
        // it had answered (the command stopped reading, the exec is over) and the answer was
        // lost with the connection. The exec's own stream says how it ended (a daemon that
        // died ends that stream too).
        const code = (e as { cause?: { code?: string } } | undefined)?.cause?.code;
        if (e instanceof Unavailable && (code === "EPIPE" || code === "ECONNRESET")) return;
        // else the command would wait for the end of its stdin for ever: the exec fails
        pumpError = e;
        res?.destroy();
      });
    });
    try {
      res = await this._http.open("POST", `${this.path}/exec`, {
        json: body, headers: { Accept: CONTENT_TYPE }, signal,
      });
      try {
        for await (const chunk of iterate(res, "exec", signal)) await reader.feed(chunk);
        signal?.throwIfAborted();
      } catch (e) {
        res.destroy();  // the daemon sees the client leave and kills the command
        throw pumpError ?? e;
      }
      if (pumpError !== undefined) throw pumpError;
    } finally {
      signal?.removeEventListener("abort", stopPump);
      pumpStop.abort();
      if (pump !== undefined) await pump;
    }
    return reader.finish();
  }

  toString(): string {
    return `Sandbox(${this.id}, template=${this._info.template})`;
  }
}

/** `sbx.network`: the sandbox's egress policy and the record of its connections. */
export class Network {
  /** @internal */
  constructor(private readonly sbx: Sandbox) {}

  /** The policy as of the last answer about the sandbox (`sbx.info()` refreshes). */
  get policy(): SandboxInfo["network"] {
    return this.sbx._info.network;
  }

  /** A new policy; the sandbox's new connections follow it at once. */
  async update(network: NetworkPolicy): Promise<SandboxInfo["network"]> {
    this.sbx._info = await this.sbx._http.request<SandboxInfo>(
      "POST", `/sandboxes/${encodeURIComponent(this.sbx.id)}/network`, { json: { network } });
    return this.sbx._info.network;
  }

  /** Outbound attempts, newest first: time, proto, dst, port, name, verdict, rule, bytes. */
  async connections(opts: { limit?: number } = {}): Promise<Record<string, unknown>[]> {
    const d = await this.sbx._http.request<{ connections: Record<string, unknown>[] }>(
      "GET", `/sandboxes/${encodeURIComponent(this.sbx.id)}/connections`,
      { query: { limit: opts.limit ?? 100 } });
    return d.connections;
  }
}
