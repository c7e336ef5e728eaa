// `npm test` after the build: the generated types' staleness check, then the node:test
// suites (one file at a time: each e2e file starts a daemon of its own on a small machine).
import { spawnSync } from "node:child_process";
import { readdirSync } from "node:fs";
import { resolve } from "node:path";
import { SDK_DIR } from "./python.mjs";

const check = spawnSync(process.execPath, [resolve(SDK_DIR, "scripts", "gen-types.mjs"), "--check"],
                        { stdio: "inherit" });
if (check.status !== 0) process.exit(check.status ?? 1);

const only = process.argv.slice(2);
const files = readdirSync(resolve(SDK_DIR, "build"))
  .filter((f) => f.endsWith(".test.js"))
  .filter((f) => only.length === 0 || only.some((o) => f.startsWith(o)))
  .sort()
  .map((f) => resolve(SDK_DIR, "build", f));
const run = spawnSync(process.execPath, ["--test", "--test-concurrency=1", ...files],
                      { stdio: "inherit", cwd: SDK_DIR });
process.exit(run.status ?? 1);
