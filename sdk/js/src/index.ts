/**
 * @cpuos/sdk: disposable, isolated Linux sandboxes for AI agents.
 *
 * ```ts
 * import { Sandbox } from "@cpuos/sdk"
 * const sbx = await Sandbox.create({ template: "python", timeout: "15m" })
 * const run = await sbx.exec("python analysis.py", { onStdout: (line) => console.log(line) })
 * ```
 *
 * Configuration: `CPUOS_API_URL` and `CPUOS_API_KEY`; with no key set, the local daemon's
 * `$CPUOS_HOME/admin.key` (default /var/lib/cpuos/admin.key) and http://127.0.0.1:7770.
 */
export {
  Sandbox, Network, type CreateOptions, type ExecOptions, type BackgroundExecOptions,
} from "./sandbox.js";
export {
  Commands, CommandHandle, type RunOptions, type FollowOptions, type StdinSource,
} from "./commands.js";
export { ExecResult, type OutputCallback } from "./exec.js";
export {
  Files, READ_MAX_BYTES, DOWNLOAD_MAX_BYTES, type CallOptions, type ReadOptions,
} from "./files.js";
export { Ports } from "./ports.js";
export {
  Workspace, type ApiKeyInfo, type KeyOptions, type NewWorkspace, type WorkspaceDeleted,
  type WorkspaceRecord,
} from "./workspace.js";
export {
  CpuosError, AuthError, PermissionDenied, NotFound, Conflict, InvalidArgument, LimitExceeded,
  NoSpace, Timeout, Unavailable, ServerError, type ErrorOptions,
} from "./errors.js";
export { DEFAULT_URL, type ConnectionOptions } from "./config.js";
export { parseDuration, parseSizeMib, type Duration, type Size } from "./durations.js";
export type {
  SandboxInfo, FileEntry, PortInfo, NetworkPolicy, CreateSandboxBody, ExecBody, CommandInfo,
} from "./models.js";
export type { components, paths } from "./generated/openapi.js";
