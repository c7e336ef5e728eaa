// The Python that has cpuos installed (for the OpenAPI document, the error-code table and
// the test daemon): $CPUOS_PYTHON, else the repository's .venv, else none.
import { existsSync } from "node:fs";
import { fileURLToPath } from "node:url";
import { dirname, resolve } from "node:path";

export const SDK_DIR = resolve(dirname(fileURLToPath(import.meta.url)), "..");
export const REPO_DIR = resolve(SDK_DIR, "..", "..");

export function findPython() {
  if (process.env.CPUOS_PYTHON) return process.env.CPUOS_PYTHON;
  const venv = resolve(REPO_DIR, ".venv", "bin", "python");
  return existsSync(venv) ? venv : null;
}
