/** End-to-end: the SDK against a real daemon (test/daemon.py: real cpuosd, real runsc). */
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { createHash, randomBytes } from "node:crypto";
import { existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { after, before, describe, it } from "node:test";
import { promisify } from "node:util";
import {
  AuthError, Conflict, CpuosError, InvalidArgument, NotFound, PermissionDenied, Sandbox,
  Workspace,
} from "@cpuos/sdk";
import { REPO_DIR, SDK_DIR, startDaemon, waitUntil, type TestDaemon } from "./helpers.js";

const started = await startDaemon();
const skip = "skip" in started ? started.skip : false;
const daemon = started as TestDaemon;
const T = { timeout: 180_000 };

describe("e2e", { skip }, () => {
  let conn: { apiUrl: string; apiKey: string };
  let sbx: Sandbox;
  let failed = false;

  before(async () => {
    conn = { apiUrl: daemon.url, apiKey: daemon.key };
    sbx = await Sandbox.create({ template: "python", timeout: "10m", ...conn });
  });

  after(async () => {
    try {
      await sbx?.kill();
    } finally {
      await daemon.stop(failed);
    }
  });

  const test = (name: string, fn: () => Promise<void>) =>
    it(name, T, async () => {
      try {
        await fn();
      } catch (e) {
        failed = true;
        throw e;
      }
    });

  test("the README snippet, verbatim, with an analysis.py that prints and saves a chart",
       async () => {
    const src = readFileSync(resolve(SDK_DIR, "test", "snippet.ts"), "utf8").split("\n")
      .filter((l) => !l.startsWith("//") && !l.endsWith("// test:") && l.trim());
    for (const readme of [resolve(SDK_DIR, "README.md"), resolve(REPO_DIR, "README.md")]) {
      const text = readFileSync(readme, "utf8");
      const block = /```ts\n([\s\S]*?)```/.exec(text)?.[1]?.trim().split("\n");
      assert.deepEqual(src, block, `test/snippet.ts is not the snippet in ${readme}`);
    }

    const { stdout } = await promisify(execFile)(
      process.execPath, [resolve(SDK_DIR, "build", "snippet.js")],
      { env: { ...process.env, CPUOS_API_URL: daemon.url, CPUOS_API_KEY: daemon.key },
        timeout: 170_000 });
    const lines = stdout.trim().split("\n");
    const out = JSON.parse(lines.pop()!) as { id: string; exitCode: number; stderr: string;
                                              chartBytes: number; chartHead: string };
    assert.equal(out.exitCode, 0, out.stderr);
    assert.deepEqual(lines, [...Array(10).keys()].map((x) => `${x} squared is ${x * x}`)
      .concat(["saved /work/chart.png"]));
    assert.equal(out.chartHead, "89504e470d0a1a0a");  // a PNG
    assert.ok(out.chartBytes > 1000, `chart of ${out.chartBytes} bytes`);

    const paused = await Sandbox.connect(out.id, { autoResume: false, ...conn });
    assert.equal((await paused.info()).state, "paused");
    const back = await Sandbox.resume(out.id, conn);
    try {
      assert.equal((await back.info()).state, "running");
      const chart = await back.files.read("/work/chart.png");
      assert.equal(chart.length, out.chartBytes);
    } finally {
      await back.kill();
    }
  });

  test("stdout and stderr: in order, apart, line by line or as chunks", async () => {
    const cmd = "for i in $(seq 1 300); do echo out$i; echo err$i >&2; done; printf tail";
    const out: string[] = [];
    const err: string[] = [];
    const run = await sbx.exec(cmd, { onStdout: (l) => { out.push(l); },
                                      onStderr: async (l) => { err.push(l); } });
    const n = [...Array(300).keys()].map((i) => i + 1);
    assert.deepEqual(out, [...n.map((i) => `out${i}`), "tail"]);
    assert.deepEqual(err, n.map((i) => `err${i}`));
    assert.equal(run.stdout, n.map((i) => `out${i}\n`).join("") + "tail");
    assert.equal(run.stderr, n.map((i) => `err${i}\n`).join(""));
    assert.ok(run.ok);

    const chunks: string[] = [];
    const raw = await sbx.exec(["python3", "-c", "import sys\nfor i in range(50): " +
      "sys.stdout.write('x' * 1000 + '\\n'); sys.stdout.flush()"],
      { lines: false, onStdout: (c) => { chunks.push(c); } });
    assert.equal(chunks.join(""), raw.stdout);
    assert.equal(raw.stdout.length, 50 * 1001);
  });

  test("exit codes 0, 1 and 137 (SIGKILL)", async () => {
    assert.equal((await sbx.exec("true")).exitCode, 0);
    const one = await sbx.exec("echo nope >&2; exit 1");
    assert.equal(one.exitCode, 1);
    assert.equal(one.stderr, "nope\n");
    assert.ok(!one.ok);
    const killed = await sbx.exec("kill -9 $$");
    assert.equal(killed.exitCode, 137);
    assert.equal(killed.timedOut, false);
  });

  test("env, cwd and stdin reach the command", async () => {
    const r = await sbx.exec("echo $GREETING; pwd; cat", {
      env: { GREETING: "hello" }, cwd: "/tmp", stdin: new TextEncoder().encode("from stdin") });
    assert.equal(r.stdout, "hello\n/tmp\nfrom stdin");
  });

  test("stdin streamed from an async iterable: hashed, answered line by line, cut short",
       async () => {
    const parts = [...Array(8).keys()].map(() => randomBytes(1 << 20));
    const sum = await sbx.exec("sha256sum", { stdin: (async function* () { yield* parts; })() });
    assert.equal(sum.stdout.split(" ")[0],
                 createHash("sha256").update(Buffer.concat(parts)).digest("hex"));

    // each line is produced only once the command has answered the one before
    const answers: string[] = [];
    let answered: (() => void) | undefined;
    async function* questions() {
      for (const q of ["a", "b", "c"]) {
        yield `${q}\n`;
        await new Promise<void>((r) => { answered = r; });
      }
    }
    const repl = await sbx.exec("while read l; do echo got:$l; done", {
      stdin: questions(), onStdout: (l) => { answers.push(l); answered?.(); } });
    assert.deepEqual(answers, ["got:a", "got:b", "got:c"]);
    assert.equal(repl.exitCode, 0);

    // the command stops reading early: the exec is fine. (The rest of the upload is not
    // refused: the daemon answers its stdin request at once but reads the remaining body
    // to keep the connection, so how much of the iterable is pulled is a race; known)
    let produced = 0;
    async function* endless() {
      for (let i = 0; i < 256; i++) {  // 64 MiB at most
        produced++;
        yield new Uint8Array(256 << 10).fill(120);
      }
    }
    const head = await sbx.exec("head -c 5", { stdin: endless() });
    assert.equal(head.stdout, "xxxxx");
    assert.equal(head.exitCode, 0);
    assert.ok(produced >= 1 && produced <= 256, `${produced} chunks were produced`);
  });

  test("an exec timeout kills the command: exit 137, timedOut, sandbox usable", async () => {
    const r = await sbx.exec("echo started; sleep 60; echo never", { timeout: "1s" });
    assert.equal(r.timedOut, true);
    assert.equal(r.exitCode, 137);
    assert.equal(r.stdout, "started\n");
    assert.equal((await sbx.exec("echo alive")).stdout, "alive\n");
    await assert.rejects(sbx.exec("true", { timeout: "soon" }), InvalidArgument);
  });

  test("AbortSignal: aborting a long exec kills the command inside", async () => {
    const ac = new AbortController();
    let pid = "";
    const p = sbx.exec("echo $$; exec sleep 612", {
      signal: ac.signal,
      onStdout: async (line) => {
        pid = line.trim();
        // the command is alive (so the check below could fail), then we leave
        assert.equal((await sbx.exec(`kill -0 ${pid}`)).exitCode, 0);
        ac.abort();
      },
    });
    await assert.rejects(p, (e: Error) => e.name === "AbortError");
    assert.match(pid, /^\d+$/);
    await waitUntil(async () => (await sbx.exec(`kill -0 ${pid}`)).exitCode !== 0,
                    `sleep (pid ${pid}) to be killed inside the sandbox`);
    const ps = await sbx.exec("ps -eo args");
    assert.ok(!ps.stdout.includes("sleep 612"), ps.stdout);
    await assert.rejects(sbx.exec("true", { signal: AbortSignal.abort() }),
                         (e: Error) => e.name === "AbortError");
  });

  test("files: a 10 MiB round trip by sha256, strings, list, exists, remove", async () => {
    const data = new Uint8Array(randomBytes(10 << 20));
    const sha = createHash("sha256").update(data).digest("hex");
    const entry = await sbx.files.write("/work/big.bin", data);
    assert.equal(entry.size, 10 << 20);
    const inside = await sbx.exec("sha256sum /work/big.bin");
    assert.equal(inside.stdout.split(" ")[0], sha);
    const back = await sbx.files.read("/work/big.bin");
    assert.equal(back.length, data.length);
    assert.equal(createHash("sha256").update(back).digest("hex"), sha);

    await sbx.files.write("notes/hello.txt", "héllo\n");  // relative: under /work
    assert.equal(await sbx.files.readText("/work/notes/hello.txt"), "héllo\n");
    const names = (await sbx.files.list("/work")).map((e) => `${e.name}:${e.type}`);
    assert.ok(names.includes("big.bin:file") && names.includes("notes:dir"), String(names));
    assert.equal(await sbx.files.exists("/work/notes/hello.txt"), true);
    await sbx.files.remove("/work/notes");
    assert.equal(await sbx.files.exists("/work/notes/hello.txt"), false);
    await assert.rejects(sbx.files.read("/work/nope"), NotFound);
  });

  test("files: upload and download stream local files", async () => {
    const dir = mkdtempSync(join(tmpdir(), "cpuos-js-files-"));
    try {
      const data = randomBytes(5 << 20);
      writeFileSync(join(dir, "up.bin"), data);
      const entry = await sbx.files.upload(join(dir, "up.bin"), "/work/up.bin");
      assert.equal(entry.size, data.length);
      const n = await sbx.files.download("/work/up.bin", join(dir, "down.bin"));
      assert.equal(n, data.length);
      assert.ok(readFileSync(join(dir, "down.bin")).equals(data));
      await assert.rejects(sbx.files.download("/work/nope", join(dir, "nope.bin")), NotFound);
      assert.equal(existsSync(join(dir, "nope.bin")), false);
      await assert.rejects(sbx.files.upload(join(dir, "missing"), "/work/x"),
                           (e: NodeJS.ErrnoException) => e.code === "ENOENT");
      assert.equal(await sbx.files.exists("/work/x"), false);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  test("a 1 TiB sparse file: read and download refuse it at once (too_large)", async () => {
    // issue 25, finding 11: the daemon announces the size, the SDK bounds what it accepts
    const made = await sbx.exec("truncate -s 1T /work/big && head -c 3145728 /dev/urandom " +
                                "> /work/three.bin && stat -c %s /work/big");
    assert.equal(made.stdout.trim(), String(2 ** 40));
    const tooLarge = (e: CpuosError) =>
      e instanceof InvalidArgument && e.code === "too_large" && e.status === 413;
    const rss = process.memoryUsage().rss;
    await assert.rejects(sbx.files.read("/work/big"), tooLarge);
    await assert.rejects(sbx.files.read("/work/big", { maxBytes: null }), tooLarge);  // daemon cap
    const dir = mkdtempSync(join(tmpdir(), "cpuos-js-big-"));
    try {
      await assert.rejects(sbx.files.download("/work/big", join(dir, "big")), tooLarge);
      assert.equal(existsSync(join(dir, "big")), false);
      await assert.rejects(sbx.files.read("/work/three.bin", { maxBytes: 1 << 20 }), tooLarge);
      assert.equal((await sbx.files.read("/work/three.bin", { maxBytes: 3 << 20 })).length,
                   3 << 20);
      // chunks() has no default bound; a limit given is enforced as the bytes arrive
      let got = 0;
      await assert.rejects((async () => {
        for await (const c of sbx.files.chunks("/work/three.bin", { maxBytes: 1 << 20 })) {
          got += c.length;
        }
      })(), tooLarge);
      assert.ok(got <= 1 << 20, `${got} bytes passed the limit`);
    } finally {
      rmSync(dir, { recursive: true, force: true });
      await sbx.exec("rm -f /work/big /work/three.bin");
    }
    assert.ok(process.memoryUsage().rss - rss < 256 << 20);
  });

  test("bad input maps to the error classes: 404, 401, 409, 422; limits at create", async () => {
    await assert.rejects(Sandbox.connect("sbx-doesnotexist", conn), (e: CpuosError) =>
      e instanceof NotFound && e.status === 404 && e.code === "not_found");
    await assert.rejects(Sandbox.list({ apiUrl: daemon.url, apiKey: "wrong" }),
                         (e: CpuosError) => e instanceof AuthError && e.status === 401);
    await assert.rejects(Sandbox.create({ template: "No Such_Template!", ...conn }),
                         (e: CpuosError) => e instanceof InvalidArgument && e.status === 422);
    await assert.rejects(sbx.files.list("/work/big.bin"), (e: CpuosError) =>
      e instanceof Conflict && e.status === 409 && e.code === "not_a_directory");
    await assert.rejects(Sandbox.create({ memory: "lots", ...conn }), InvalidArgument);
    const gone = await Sandbox.create({ template: "python", timeout: "2m", cpus: 1,
                                        memory: "512MiB", disk: "1GiB", pids: 128, ...conn });
    const limits = await gone.info();
    assert.deepEqual([limits.vcpus, limits.memory_mib, limits.disk_mib, limits.pids],
                     [1, 512, 1024, 128]);
    await gone.kill();
    await assert.rejects(gone.exec("true"), (e: CpuosError) =>
      e instanceof Conflict && e.status === 409);
    await gone.kill();  // already killed: no error
  });

  test("background: a handle, stdin, wait, reattach from another client, kill", async () => {
    const out: string[] = [];
    // (it reads on to the end of its stdin: a command that exits as soon as it has read
    // a line can make the daemon answer the write that fed it with "stdin is closed")
    const h = await sbx.exec(
      "echo ready; read line; echo got:$line; echo err >&2; cat >/dev/null; exit 3",
      { background: true, onStdout: (l) => { out.push(l); } });
    assert.ok(Number.isInteger(h.pid) && h.pid > 0);
    assert.ok((await sbx.commands.list()).some((c) => c.pid === h.pid));
    assert.equal(await h.sendStdin("hello\n"), 6);
    await h.closeStdin();
    const r = await h.wait();
    assert.equal(r.exitCode, 3);
    assert.equal(r.stdout, "ready\ngot:hello\n");
    assert.equal(r.stderr, "err\n");
    assert.deepEqual(out, ["ready", "got:hello"]);

    // another client, after this one is done with it: the output again from offset 0
    const other = await Sandbox.connect(sbx.id, conn);
    const again = await other.commands.connect(h.pid);
    const r2 = await again.wait();
    assert.equal(r2.stdout, r.stdout);
    assert.equal(r2.exitCode, 3);
    await assert.rejects(other.commands.connect(999999), NotFound);

    // stdin streamed from an async iterable, closed, hashed inside
    const parts = [0, 1, 2, 3].map(() => randomBytes(1 << 20));
    const sum = await sbx.exec("sha256sum", { background: true });
    assert.equal(await sum.sendStdin((async function* () { yield* parts; })()), 4 << 20);
    await sum.closeStdin();
    const hashed = await sum.wait();
    assert.equal(hashed.stdout.split(" ")[0],
                 createHash("sha256").update(Buffer.concat(parts)).digest("hex"));

    const sleeper = await sbx.exec(["sleep", "600"], { background: true });
    assert.equal((await sleeper.info()).running, true);
    await sleeper.kill("TERM");
    const ended = await sleeper.wait();
    assert.equal(ended.signal, 15);
    assert.equal((await sleeper.info()).running, false);
  });

  test("setTimeout, list, fork, ports.expose", async () => {
    const before = (await sbx.info()).deadline!;
    const info = await sbx.setTimeout("20m");
    assert.ok(info.deadline! > before + 60, `${info.deadline} vs ${before}`);
    assert.ok((await Sandbox.list(conn)).some((s) => s.id === sbx.id));

    await sbx.files.write("/work/forked.txt", "from the parent");
    const [child] = await sbx.fork(1);
    try {
      assert.ok(child && child.id !== sbx.id);
      assert.equal(await child.files.readText("/work/forked.txt"), "from the parent");
      assert.equal((await child.exec("echo child")).stdout, "child\n");
    } finally {
      await child?.kill();
    }

    const url = await sbx.ports.expose(8000);
    assert.match(url, new RegExp(`/sandboxes/${sbx.id}/ports/8000/\\?cpuos_token=[\\w-]+$`));
    assert.deepEqual((await sbx.ports.list()).map((p) => p.port), [8000]);
  });

  test("workspaces: keys made, listed, revoked; a workspace deleted with its sandboxes",
       async () => {
    const admin = new Workspace(conn);
    const made = await admin.createWorkspace(`js-${randomBytes(3).toString("hex")}`);
    const tconn = { apiUrl: daemon.url, apiKey: made.key };
    const ws = new Workspace(tconn);
    const ci = await ws.createKey("ci");
    assert.ok(ci.key?.startsWith("cpk_"));
    const keys = await ws.keys();
    assert.deepEqual(keys.map((k) => k.label), ["default", "ci"]);
    assert.ok(keys.every((k) => k.key == null) && keys[0]?.current === true);
    await Sandbox.list({ apiUrl: daemon.url, apiKey: ci.key! });
    await ws.revokeKey(ci.id);
    await assert.rejects(Sandbox.list({ apiUrl: daemon.url, apiKey: ci.key! }), AuthError);
    await assert.rejects(ws.revokeKey(keys[0]!.id), Conflict);  // its own last live key
    await assert.rejects(ws.listWorkspaces(), PermissionDenied);
    await assert.rejects(ws.keys({ workspace: "ws-000000000000" }), NotFound);
    const theirs = await Sandbox.create({ template: "python", timeout: "5m", ...tconn });
    const gone = await admin.deleteWorkspace(made.id);
    assert.deepEqual(gone.sandboxes_killed, [theirs.id]);
    assert.equal(gone.keys_revoked, 1);
    await assert.rejects(theirs.info(), AuthError);
    assert.ok(!(await admin.listWorkspaces()).some((w) => w.id === made.id));
    assert.equal((await sbx.exec("echo still")).stdout, "still\n");  // ours: untouched
  });

  test("idleTimeout: paused when idle (info does not wake it), an exec resumes it", async () => {
    const idle = await Sandbox.create({ template: "python", idleTimeout: "2s", ...conn });
    try {
      assert.equal((await idle.info()).idle_timeout, 2);
      await idle.files.write("/work/kept.txt", "kept");
      await waitUntil(async () => {
        const i = await idle.info();
        return i.state === "paused" && i.reason === "idle";
      }, "paused for idleness", 120_000);
      assert.equal((await idle.exec("cat /work/kept.txt")).stdout, "kept");
      assert.equal((await idle.info()).state, "running");
      assert.equal((await idle.setIdleTimeout(0)).idle_timeout, 0);
    } finally {
      await idle.kill();
    }
  });
});
