/**
 * Where the daemon is and which key to use: `CPUOS_API_URL` / `CPUOS_API_KEY`; with no key
 * set, the local daemon's `$CPUOS_HOME/admin.key` (default /var/lib/cpuos/admin.key) when
 * it is readable, so the SDK just works on the machine that runs the daemon.
 */
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { AuthError, InvalidArgument } from "./errors.js";

export const DEFAULT_URL = "http://127.0.0.1:7770";

/** How to reach the daemon; each defaults from the environment as described above. */
export interface ConnectionOptions {
  apiUrl?: string;
  apiKey?: string;
}

export function resolveConfig(opts: ConnectionOptions = {}): { url: string; key: string } {
  const url = opts.apiUrl || process.env.CPUOS_API_URL || DEFAULT_URL;
  let key = opts.apiKey || process.env.CPUOS_API_KEY;
  if (!key) {
    const path = join(process.env.CPUOS_HOME || "/var/lib/cpuos", "admin.key");
    try {
      key = readFileSync(path, "utf8").trim();
    } catch {
      throw new AuthError(
        "no API key: set CPUOS_API_KEY (or run where the daemon's admin.key is readable)");
    }
  }
  let parsed: URL;
  try {
    parsed = new URL(url);
  } catch {
    throw new InvalidArgument(`bad API URL ${JSON.stringify(url)}`);
  }
  if (parsed.protocol !== "http:" && parsed.protocol !== "https:") {
    throw new InvalidArgument(`API URL must be http or https, got ${JSON.stringify(url)}`);
  }
  return { url: url.replace(/\/+$/, ""), key };
}
