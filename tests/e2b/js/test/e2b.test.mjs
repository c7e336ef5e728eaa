// E2B's own JS SDKs (`e2b`, `@e2b/code-interpreter`, unchanged, from npm) against a real
// cpuosd, configured only by E2B's environment variables (E2B_API_URL, E2B_SANDBOX_URL,
// E2B_API_KEY: an e2b_<hex> key, the shape the JS SDK checks). Run by tests/e2b/test_e2b_js.py.
import assert from "node:assert/strict"
import http from "node:http"
import { after, before, test } from "node:test"

import { Sandbox as CodeSandbox } from "@e2b/code-interpreter"
import { CommandExitError, FilesystemEventType, Sandbox } from "e2b"

for (const name of ["E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY"]) {
  assert.ok(process.env[name], `${name} must be set (tests/e2b/test_e2b_js.py sets it)`)
}

const waitFor = async (cond, what, ms = 30000) => {
  const end = Date.now() + ms
  while (!(await cond())) {
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`)
    await new Promise((r) => setTimeout(r, 100))
  }
}

let sbx
before(async () => {
  sbx = await Sandbox.create({ timeoutMs: 600_000, envs: { GREETING: "hi" },
                               metadata: { suite: "js" } })
})
after(async () => {
  await sbx?.kill()
})

test("lifecycle: info, list, timeout, connect", async () => {
  const info = await sbx.getInfo()
  assert.equal(info.sandboxId, sbx.sandboxId)
  assert.equal(info.state, "running")
  assert.deepEqual(info.metadata, { suite: "js" })
  const listed = await Sandbox.list({ query: { metadata: { suite: "js" } } }).nextItems()
  assert.deepEqual(listed.map((s) => s.sandboxId), [sbx.sandboxId])
  await sbx.setTimeout(900_000)
  assert.ok((await sbx.getInfo()).endAt > info.endAt)
  const same = await Sandbox.connect(sbx.sandboxId)
  assert.equal((await same.commands.run("echo $((6*7))")).stdout, "42\n")
  assert.equal(await sbx.isRunning(), true)
})

test("commands: output, callbacks, exit codes, cwd, envs", async () => {
  const out = []
  const r = await sbx.commands.run("echo $GREETING $X; echo e >&2; pwd",
    { envs: { X: "y" }, onStdout: (d) => out.push(d) })
  assert.equal(r.exitCode, 0)
  assert.equal(r.stdout, "hi y\n/home/user\n")
  assert.equal(r.stderr, "e\n")
  assert.equal(out.join(""), r.stdout)
  assert.equal((await sbx.commands.run("pwd", { cwd: "/tmp" })).stdout, "/tmp\n")
  await assert.rejects(sbx.commands.run("exit 7"), (e) => e instanceof CommandExitError &&
    e.exitCode === 7)
})

test("commands: background, list, kill, stdin", async () => {
  const h = await sbx.commands.run("sleep 60", { background: true })
  assert.ok((await sbx.commands.list()).some((p) => p.pid === h.pid))
  assert.equal(await sbx.commands.kill(h.pid), true)
  await assert.rejects(h.wait(), CommandExitError)
  const cat = await sbx.commands.run("cat", { background: true, stdin: true })
  await sbx.commands.sendStdin(cat.pid, "abc\n")
  await sbx.commands.closeStdin(cat.pid)
  assert.equal((await cat.wait()).stdout, "abc\n")
})

test("files: text, bytes, list, exists, makeDir, many, remove, watch", async () => {
  await sbx.files.write("js/a.txt", "text")
  assert.equal(await sbx.files.read("js/a.txt"), "text")
  const bytes = new Uint8Array(70000).map((_, i) => i % 251)
  await sbx.files.write("/tmp/b.bin", bytes.buffer)
  assert.deepEqual(new Uint8Array(await sbx.files.read("/tmp/b.bin", { format: "bytes" })),
    bytes)
  assert.equal(await sbx.files.exists("js/a.txt"), true)
  assert.equal(await sbx.files.exists("js/none"), false)
  assert.equal(await sbx.files.makeDir("js/d"), true)
  assert.equal(await sbx.files.makeDir("js/d"), false)
  await sbx.files.write(Array.from({ length: 10 }, (_, i) => ({ path: `js/m/f${i}`,
    data: `n${i}` })))
  assert.equal((await sbx.files.list("js/m")).length, 10)
  await sbx.files.remove("js/m")
  assert.equal(await sbx.files.exists("js/m"), false)
  const events = []
  const w = await sbx.files.watchDir("js", (e) => events.push(e))
  try {
    await sbx.files.write("js/watched.txt", "x")
    await waitFor(() => events.some((e) => e.name === "watched.txt" &&
      e.type === FilesystemEventType.CREATE), "a create event")
  } finally {
    await w.stop()
  }
})

test("getHost reaches python -m http.server inside", async () => {
  await sbx.files.write("site/index.html", "from inside (js)")
  const srv = await sbx.commands.run("cd ~/site && exec python3 -m http.server 8001",
    { background: true, timeoutMs: 0 })
  try {
    const host = sbx.getHost(8001)
    const port = Number(host.split(":").pop())
    const get = () => new Promise((resolve) => {
      // (*.localhost is loopback; connect by address with the Host header)
      const req = http.get({ host: "127.0.0.1", port, path: "/index.html",
                             headers: { Host: host } }, (res) => {
        let body = ""
        res.on("data", (c) => { body += c })
        res.on("end", () => resolve(res.statusCode === 200 ? body : null))
      })
      req.on("error", () => resolve(null))
    })
    await waitFor(async () => (await get()) !== null, "the server inside", 60000)
    assert.equal(await get(), "from inside (js)")
  } finally {
    await srv.kill()
  }
})

test("pause and connect (resume)", async () => {
  const s = await Sandbox.create({ timeoutMs: 300_000 })
  try {
    await s.commands.run("echo kept > ~/k.txt")
    assert.equal(await s.pause(), true)
    assert.equal((await Sandbox.getInfo(s.sandboxId)).state, "paused")
    const again = await Sandbox.connect(s.sandboxId)
    assert.equal(await again.files.read("k.txt"), "kept\n")
  } finally {
    await s.kill()
  }
})

test("code interpreter: state, error, chart", async () => {
  const c = await CodeSandbox.create({ timeoutMs: 300_000 })
  try {
    await c.runCode("x = 41")
    const out = []
    const ex = await c.runCode("print('side'); x + 1", { onStdout: (m) => out.push(m.line) })
    assert.equal(ex.text, "42")
    assert.deepEqual(out, ["side\n"])
    const err = await c.runCode("1/0")
    assert.equal(err.error?.name, "ZeroDivisionError")
    const fig = await c.runCode("import matplotlib.pyplot as plt\nplt.plot([1,2])\nplt.show()")
    const png = fig.results.find((r) => r.png)?.png
    assert.ok(png)
    assert.deepEqual([...Buffer.from(png, "base64").subarray(0, 4)], [0x89, 0x50, 0x4e, 0x47])
  } finally {
    await c.kill()
  }
})
