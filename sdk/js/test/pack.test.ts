/** `npm pack` makes a package that installs and imports elsewhere, with its types. */
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { mkdtempSync, rmSync, writeFileSync, readFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { after, describe, it } from "node:test";
import { promisify } from "node:util";
import { SDK_DIR } from "./helpers.js";

const run = promisify(execFile);
const npm = process.platform === "win32" ? "npm.cmd" : "npm";

describe("npm pack", () => {
  const dir = mkdtempSync(join(tmpdir(), "cpuos-js-pack-"));
  after(() => rmSync(dir, { recursive: true, force: true }));

  it("installs into an empty project, imports, type-checks and runs", { timeout: 180_000 },
     async () => {
    // dist/ is built by `npm test` before the suites run; the pack takes it as it is
    const { stdout } = await run(npm, ["pack", "--ignore-scripts", "--json",
                                       "--pack-destination", dir], { cwd: SDK_DIR });
    const [info] = JSON.parse(stdout) as { filename: string; files: { path: string }[] }[];
    assert.ok(info);
    const files = info.files.map((f) => f.path).sort();
    for (const f of ["package.json", "README.md", "dist/index.js", "dist/index.d.ts",
                     "dist/generated/openapi.d.ts"]) {
      assert.ok(files.includes(f), `${f} not in the package: ${files}`);
    }
    assert.deepEqual(files.filter((f) => !f.startsWith("dist/") && f !== "package.json" &&
                                          f !== "README.md"), []);

    const app = join(dir, "app");
    await run("mkdir", ["-p", app]);
    writeFileSync(join(app, "package.json"), JSON.stringify({ name: "app", private: true,
                                                               type: "module" }));
    await run(npm, ["install", "--offline", "--no-audit", "--no-fund",
                    join(dir, info.filename)], { cwd: app });
    const pkg = JSON.parse(readFileSync(join(app, "node_modules", "@cpuos", "sdk",
                                             "package.json"), "utf8")) as
      { dependencies?: Record<string, string> };
    assert.equal(pkg.dependencies, undefined, "no runtime dependencies");

    // a program of the consumer's: types from the package, run against no daemon
    writeFileSync(join(app, "main.ts"), `
import { Sandbox, Unavailable, CpuosError, type SandboxInfo, type ExecResult } from "@cpuos/sdk"
const check: (r: ExecResult) => number = (r) => r.exitCode
void check
try {
  const all: SandboxInfo[] = await Sandbox.list({ apiUrl: "http://127.0.0.1:9", apiKey: "k" })
  console.log("unexpected", all.length)
} catch (e) {
  console.log(e instanceof Unavailable && e instanceof CpuosError ? "unavailable" : String(e))
}
`);
    writeFileSync(join(app, "tsconfig.json"), JSON.stringify({ compilerOptions: {
      target: "ES2022", module: "NodeNext", moduleResolution: "NodeNext", strict: true,
      skipLibCheck: false, typeRoots: [join(SDK_DIR, "node_modules", "@types")],
      types: ["node"] } }));
    await run(process.execPath, [join(SDK_DIR, "node_modules", "typescript", "bin", "tsc"),
                                 "-p", app], { cwd: app });
    const out = await run(process.execPath, [join(app, "main.js")], { cwd: app });
    assert.equal(out.stdout.trim(), "unavailable");
  });
});
