/** Test helpers: a real daemon (test/daemon.py), waiting on conditions, skipping. */
import { spawn, type ChildProcess } from "node:child_process";
import { once } from "node:events";
import { dirname, resolve } from "node:path";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";
import { existsSync } from "node:fs";

export const SDK_DIR = resolve(dirname(fileURLToPath(import.meta.url)), "..");
export const REPO_DIR = resolve(SDK_DIR, "..", "..");
const CI = process.env.CI === "true";

export function findPython(): string | null {
  if (process.env.CPUOS_PYTHON) return process.env.CPUOS_PYTHON;
  const venv = resolve(REPO_DIR, ".venv", "bin", "python");
  return existsSync(venv) ? venv : null;
}

/** A reason to skip, or (in CI, where skips are failures) an error. */
export function skipOrFail(reason: string): string {
  if (CI) throw new Error(`cannot run in CI: ${reason}`);
  console.log(`# skipped: ${reason}`);
  return reason;
}

export interface TestDaemon {
  url: string;
  key: string;
  /** Tear the daemon down; rejects if it left anything behind. */
  stop(failed?: boolean): Promise<void>;
}

/** A daemon of its own, or the reason the end-to-end tests cannot run here. */
export async function startDaemon(): Promise<TestDaemon | { skip: string }> {
  const python = findPython();
  if (!python) {
    return { skip: skipOrFail("no Python with cpuos (set CPUOS_PYTHON or make .venv)") };
  }
  const proc: ChildProcess = spawn(python, [resolve(SDK_DIR, "test", "daemon.py")], {
    cwd: REPO_DIR, stdio: ["pipe", "pipe", "inherit"],
  });
  const exited = once(proc, "exit") as Promise<[number | null, string | null]>;
  const lines = createInterface({ input: proc.stdout! });
  const first: string | undefined = await new Promise((res) => {
    lines.once("line", res);
    lines.once("close", () => res(undefined));
  });
  if (first === undefined) {
    const [code] = await exited;
    throw new Error(`test/daemon.py exited (${code}) without starting a daemon`);
  }
  const d = JSON.parse(first) as { url: string; key: string } | { skip: string };
  if ("skip" in d) {
    await exited;
    return { skip: skipOrFail(d.skip) };
  }
  return {
    url: d.url, key: d.key,
    async stop(failed = false) {
      proc.stdin!.end(failed ? "failed\n" : "");
      const [code, sig] = await exited;
      if (code !== 0) throw new Error(`daemon teardown failed (exit ${code ?? sig})`);
    },
  };
}

/** Poll `cond` every 100 ms until it holds; an error naming `what` after `timeoutMs`. */
export async function waitUntil(cond: () => Promise<boolean> | boolean, what: string,
                                timeoutMs = 30_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!(await cond())) {
    if (Date.now() > deadline) throw new Error(`timed out after ${timeoutMs} ms: ${what}`);
    await new Promise((r) => setTimeout(r, 100));
  }
}
