/** Unit tests: the frame decoder, exec stream reader and duration parser against the shared
 * vectors (tests/vectors/, checked by the Python SDK too), the error table against the
 * Python one, output buffering and configuration. */
import assert from "node:assert/strict";
import { execFileSync, spawn } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { describe, it } from "node:test";
import { ERROR_CODES, errorFrom, CpuosError, NotFound, AuthError, Conflict } from "../dist/errors.js";
import { encodeFrame, FrameDecoder, MAX_HEADER, MAX_PAYLOAD, ProtocolError, type Frame }
  from "../dist/frames.js";
import { ExecStreamReader } from "../dist/exec.js";
import { OutputBuffer, TextSplitter } from "../dist/output.js";
import { parseDuration, parseSizeMib } from "../dist/durations.js";
import { resolveConfig } from "../dist/config.js";
import { HttpClient } from "../dist/http.js";
import { findPython, REPO_DIR, skipOrFail } from "./helpers.js";
import * as sdk from "@cpuos/sdk";

const VECTORS = resolve(REPO_DIR, "tests", "vectors");
interface FrameVec { header: Record<string, unknown>; payload_hex: string }
interface Valid { name: string; hex: string; canonical: boolean; pending: number; frames: FrameVec[] }
interface Stream {
  name: string; hex: string;
  expect: { error?: { code: string; class: string }; exit_code?: number; signal?: number | null;
            timed_out?: boolean; exec_id?: string; stdout_hex?: string; stderr_hex?: string;
            stdout_lines?: string[]; stderr_lines?: string[] };
}
const FRAMES = JSON.parse(readFileSync(join(VECTORS, "exec_frames.json"), "utf8")) as {
  max_header: number; max_payload: number; valid: Valid[];
  errors: { name: string; hex: string }[]; exec_streams: Stream[];
};
const DURATIONS = JSON.parse(readFileSync(join(VECTORS, "durations.json"), "utf8")) as {
  ok: [string | number, number][]; bad: unknown[];
};

const hex = (s: string) => new Uint8Array(Buffer.from(s, "hex"));

function decodeInSteps(data: Uint8Array, step: number): { frames: Frame[]; pending: number } {
  const dec = new FrameDecoder();
  const frames: Frame[] = [];
  for (let i = 0; i < Math.max(data.length, 1); i += step) {
    frames.push(...dec.feed(data.subarray(i, i + step)));
  }
  return { frames, pending: dec.pending };
}

function chunks(data: Uint8Array, step: number): Uint8Array[] {
  const out: Uint8Array[] = [];
  for (let i = 0; i < data.length; i += step) out.push(data.subarray(i, i + step));
  return out;
}

describe("frames: shared vectors", () => {
  it("has the protocol's limits", () => {
    assert.equal(FRAMES.max_header, MAX_HEADER);
    assert.equal(FRAMES.max_payload, MAX_PAYLOAD);
  });
  for (const v of FRAMES.valid) {
    it(`decodes: ${v.name}`, () => {
      const data = hex(v.hex);
      const want = v.frames.map((f) => ({ header: f.header, payload: hex(f.payload_hex) }));
      const steps = data.length < 20000 ? [data.length || 1, 1, 7, 4096] : [data.length, 4096, 65537];
      for (const step of steps) {
        const { frames, pending } = decodeInSteps(data, step);
        assert.deepEqual(frames, want, `in steps of ${step}`);
        assert.equal(pending, v.pending);
      }
      if (v.canonical) {
        const enc = Buffer.concat(want.map((f) => encodeFrame(f.header as { t: string }, f.payload)));
        assert.equal(enc.toString("hex"), v.hex);
      }
    });
  }
  for (const v of FRAMES.errors) {
    it(`refuses: ${v.name}`, () => {
      assert.throws(() => new FrameDecoder().feed(hex(v.hex)), ProtocolError);
    });
  }
  for (const v of FRAMES.exec_streams) {
    it(`exec stream: ${v.name}`, async () => {
      for (const [lines, step] of [[true, 1], [true, 3], [false, 5], [true, 1 << 20]] as const) {
        const got: Record<"out" | "err", string[]> = { out: [], err: [] };
        const r = new ExecStreamReader({
          lines, onStdout: (t) => { got.out.push(t); }, onStderr: async (t) => { got.err.push(t); },
        });
        const run = async () => {
          for (const c of chunks(hex(v.hex), step)) await r.feed(c);
          return r.finish();
        };
        const x = v.expect;
        if (x.error) {
          await assert.rejects(run, (e: unknown) => {
            assert.ok(e instanceof CpuosError);
            assert.equal(e.constructor.name, x.error!.class);
            assert.equal(e.code, x.error!.code);
            return true;
          });
          continue;
        }
        const res = await run();
        assert.equal(res.exitCode, x.exit_code);
        assert.equal(res.signal, x.signal);
        assert.equal(res.timedOut, x.timed_out);
        assert.equal(res.execId, x.exec_id);
        assert.equal(Buffer.from(res.stdoutBytes).toString("hex"), x.stdout_hex);
        assert.equal(Buffer.from(res.stderrBytes).toString("hex"), x.stderr_hex);
        if (lines) {
          assert.deepEqual(got.out, x.stdout_lines);
          assert.deepEqual(got.err, x.stderr_lines);
        } else {
          assert.equal(got.out.join(""), res.stdout);
          assert.equal(got.err.join(""), res.stderr);
        }
      }
    });
  }
});

describe("durations: shared vectors", () => {
  for (const [input, seconds] of DURATIONS.ok) {
    it(`parses ${JSON.stringify(input)}`, () => assert.equal(parseDuration(input), seconds));
  }
  for (const input of DURATIONS.bad) {
    it(`refuses ${JSON.stringify(input)}`, () => assert.throws(() => parseDuration(input), RangeError));
  }
});

const SIZES = JSON.parse(readFileSync(join(VECTORS, "sizes.json"), "utf8")) as {
  ok: [string | number, number][]; bad: unknown[];
};

describe("sizes: shared vectors", () => {
  for (const [input, mib] of SIZES.ok) {
    it(`parses ${JSON.stringify(input)}`, () => assert.equal(parseSizeMib(input), mib));
  }
  for (const input of SIZES.bad) {
    it(`refuses ${JSON.stringify(input)}`, () => assert.throws(() => parseSizeMib(input), RangeError));
  }
});

describe("errors", () => {
  it("match the Python table (cpuos._errors.ERROR_CODES)", (t) => {
    const python = findPython();
    if (!python) return t.skip(skipOrFail("no Python with cpuos for the error table"));
    const table = JSON.parse(execFileSync(python, [join(REPO_DIR, "sdk", "js", "scripts",
      "openapi.py"), "--error-codes"], { encoding: "utf8" })) as
      Record<string, { status: number; class: string }>;
    const ours = Object.fromEntries(Object.entries(ERROR_CODES).map(
      ([code, [status, cls]]) => [code, { status, class: cls.name }]));
    assert.deepEqual(ours, table);
  });
  it("maps by code, then status, else ServerError; keeps status and details", () => {
    const e = errorFrom(404, "not_found", "no such sandbox", { sandbox: "x" });
    assert.ok(e instanceof NotFound && e instanceof CpuosError && e instanceof Error);
    assert.equal(e.status, 404);
    assert.equal(e.name, "NotFound");
    assert.deepEqual(e.details, { sandbox: "x" });
    assert.ok(errorFrom(409, "is_a_directory", "x") instanceof Conflict);
    assert.equal(errorFrom(409, "is_a_directory", "x").code, "is_a_directory");
    assert.ok(errorFrom(401, undefined, "x") instanceof AuthError);
    assert.equal(errorFrom(401, undefined, "x").code, "unauthorized");
    assert.ok(errorFrom(418, "teapot", "x") instanceof sdk.ServerError);
    assert.ok(errorFrom(undefined, "unavailable", "x") instanceof sdk.Unavailable);
  });
});

describe("output", () => {
  it("keeps head and tail of a long stream", () => {
    const b = new OutputBuffer(10);
    for (let i = 0; i < 26; i++) b.add(new Uint8Array([97 + i]));
    assert.equal(Buffer.from(b.value()).toString(), "abcdevwxyz");
    assert.ok(b.truncated);
    assert.equal(b.total, 26);
    const small = new OutputBuffer(10);
    small.add(new TextEncoder().encode("abc"));
    assert.equal(Buffer.from(small.value()).toString(), "abc");
    assert.ok(!small.truncated);
  });
  it("splits lines across chunks and bounds a line's length", () => {
    const s = new TextSplitter(true, 4);
    const enc = new TextEncoder();
    assert.deepEqual(s.feed(enc.encode("ab")), []);
    assert.deepEqual(s.feed(enc.encode("c\r\nde")), ["abc"]);
    assert.deepEqual(s.feed(enc.encode("fghij")), ["defg"]);
    assert.deepEqual(s.end(), ["hij"]);
  });
});

describe("config", () => {
  it("takes arguments, then CPUOS_API_URL / CPUOS_API_KEY, then $CPUOS_HOME/admin.key", () => {
    const saved = { ...process.env };
    const home = mkdtempSync(join(tmpdir(), "cpuos-js-"));
    try {
      process.env.CPUOS_API_URL = "http://127.0.0.1:1234/";
      process.env.CPUOS_API_KEY = "envkey";
      assert.deepEqual(resolveConfig(), { url: "http://127.0.0.1:1234", key: "envkey" });
      assert.deepEqual(resolveConfig({ apiUrl: "https://x.example", apiKey: "k" }),
                       { url: "https://x.example", key: "k" });
      delete process.env.CPUOS_API_KEY;
      delete process.env.CPUOS_API_URL;
      process.env.CPUOS_HOME = home;
      assert.throws(() => resolveConfig(), AuthError);
      writeFileSync(join(home, "admin.key"), "filekey\n");
      assert.deepEqual(resolveConfig(), { url: "http://127.0.0.1:7770", key: "filekey" });
      assert.throws(() => resolveConfig({ apiUrl: "ftp://x" }), sdk.InvalidArgument);
    } finally {
      process.env = saved;
      rmSync(home, { recursive: true, force: true });
    }
  });
});

describe("http", () => {
  it("sends a request again when a kept-alive connection the server closed is reused",
     { timeout: 60_000 }, async () => {
    // a server in a process of its own that, like uvicorn, answers without a Keep-Alive
    // header and closes a connection idle for 50 ms
    const server = spawn(process.execPath, ["--input-type=module", "-e", `
      import net from "node:net";
      let n = 0;
      const s = net.createServer((sock) => {
        let buf = "";
        sock.on("data", (d) => {
          buf += d;
          const end = buf.indexOf("\\r\\n\\r\\n");
          if (end < 0) return;
          const len = Number(/content-length: *(\\d+)/i.exec(buf.slice(0, end))?.[1] ?? 0);
          if (buf.length < end + 4 + len) return;
          const method = buf.split(" ")[0];
          buf = "";
          const body = JSON.stringify({ n: ++n, method });
          sock.write("HTTP/1.1 200 OK\\r\\ncontent-type: application/json\\r\\n" +
                     "content-length: " + body.length + "\\r\\n\\r\\n" + body);
          setTimeout(() => sock.destroy(), 50);  // closed whole: a later request is reset
        });
        sock.on("error", () => {});
      });
      s.listen(0, "127.0.0.1", () => console.log(s.address().port));
    `], { stdio: ["ignore", "pipe", "inherit"] });
    try {
      const port = await new Promise<string>((res) => server.stdout!.once("data", (d) => res(String(d).trim())));
      const http = new HttpClient({ apiUrl: `http://127.0.0.1:${port}`, apiKey: "k" });
      assert.deepEqual(await http.request("GET", "/a"), { n: 1, method: "GET" });
      // this event loop is busy while the server closes the idle connection: the agent
      // still holds it as free and hands it to the next request
      Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, 500);
      assert.deepEqual(await http.request("POST", "/b", { json: {} }), { n: 2, method: "POST" });
    } finally {
      server.kill();
    }
  });
});
