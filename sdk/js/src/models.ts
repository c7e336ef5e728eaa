/** Types of the API's requests and answers, from the generated OpenAPI types. */
import type { components } from "./generated/openapi.js";

type Schemas = components["schemas"];

/** A sandbox as the daemon describes it (`GET /sandboxes/{id}`). */
export type SandboxInfo = Schemas["Sandbox"];
/** A file or directory inside a sandbox. */
export type FileEntry = Schemas["FileEntry"];
/** An exposed port (`sbx.ports.info`). */
export type PortInfo = Schemas["Port"];
/** The body of `POST /sandboxes`. */
export type CreateSandboxBody = Schemas["CreateSandbox"];
/** The body of `POST /sandboxes/{id}/exec`. */
export type ExecBody = Schemas["ExecRequest"];
export type ExecStartedFrame = Schemas["ExecStartedFrame"];
export type ExecExitFrame = Schemas["ExecExitFrame"];
export type StreamErrorFrame = Schemas["StreamErrorFrame"];
export type FileEofFrame = Schemas["FileEofFrame"];
export type SandboxList = Schemas["SandboxList"];
export type FileList = Schemas["FileList"];
export type PortList = Schemas["PortList"];
/** An egress policy: "off" | "on" | "allowlist" | { allow: ["pypi.org", "*.github.com"] }. */
export type NetworkPolicy = NonNullable<CreateSandboxBody["network"]>;
/** A background command (`sbx.commands`). */
export type CommandInfo = Schemas["CommandInfo"];
export type CommandList = Schemas["CommandList"];
export type StartCommandBody = Schemas["StartCommand"];
export type StdinResult = Schemas["StdinResult"];
