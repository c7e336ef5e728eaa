/** The caller's workspace (its limits and use, its API keys) and, with the admin key, every
 * workspace: as `cpuos.Workspace` in Python.
 *
 * ```ts
 * const ws = new Workspace()                      // CPUOS_API_URL / CPUOS_API_KEY
 * const { key } = await ws.createKey("ci")        // shown this once
 * await ws.keys()                                  // ids, labels, dates: never a key
 * await ws.revokeKey(id)                           // 401 from its next request on
 * ```
 */
import { type ConnectionOptions } from "./config.js";
import { InvalidArgument } from "./errors.js";
import { HttpClient } from "./http.js";
import type { components } from "./generated/openapi.js";

type Schemas = components["schemas"];
/** An API key of a workspace; `key` only in what `createKey` returns. */
export type ApiKeyInfo = Schemas["ApiKey"];
/** A workspace as the admin lists it (`keys`: live ones, `sandboxes`: alive ones). */
export type WorkspaceRecord = Schemas["WorkspaceRecord"];
/** What deleting a workspace did. */
export type WorkspaceDeleted = Schemas["WorkspaceDeleted"];
/** A new workspace and its first key (shown this once). */
export interface NewWorkspace {
  id: string;
  name: string;
  key: string;
  limits: Record<string, number>;
}

/** `workspace`: another workspace's id (admin key); default: the caller's. */
export interface KeyOptions {
  workspace?: string;
}

function seg(value: string, what: string): string {
  if (!value || value.includes("/") || value.length > 128) {
    throw new InvalidArgument(`bad ${what} ${JSON.stringify(value.slice(0, 80))}`);
  }
  return encodeURIComponent(value);
}

export class Workspace {
  /** @internal */
  readonly _http: HttpClient;

  constructor(opts: ConnectionOptions = {}) {
    this._http = new HttpClient(opts);
  }

  /** Its maxima and what its sandboxes hold (the admin also sees the host's room). */
  async info(): Promise<Record<string, unknown>> {
    return this._http.request<Record<string, unknown>>("GET", "/workspace");
  }

  private keysPath(opts: KeyOptions): string {
    return opts.workspace === undefined ? "/workspace/keys"
      : `/workspaces/${seg(opts.workspace, "workspace id")}/keys`;
  }

  /** The workspace's keys, revoked ones too (`current`: the key asking). */
  async keys(opts: KeyOptions = {}): Promise<ApiKeyInfo[]> {
    return (await this._http.request<Schemas["ApiKeyList"]>("GET", this.keysPath(opts))).keys;
  }

  /** A new key; its `key` is in this answer only (it is stored hashed). */
  async createKey(label = "default", opts: KeyOptions = {}): Promise<ApiKeyInfo> {
    return this._http.request<ApiKeyInfo>("POST", this.keysPath(opts), { json: { label } });
  }

  /** Revoke a key: refused (AuthError) from its next request on; its streams and terminals
   * are ended. A workspace cannot revoke its own last live key (Conflict); the admin may
   * revoke another workspace's. */
  async revokeKey(keyId: string, opts: KeyOptions = {}): Promise<ApiKeyInfo> {
    return this._http.request<ApiKeyInfo>(
      "DELETE", `${this.keysPath(opts)}/${seg(keyId, "key id")}`);
  }

  /** Every workspace (admin). */
  async listWorkspaces(opts: { deleted?: boolean } = {}): Promise<WorkspaceRecord[]> {
    return (await this._http.request<Schemas["WorkspaceList"]>(
      "GET", "/workspaces", { query: { deleted: opts.deleted ?? false } })).workspaces;
  }

  /** A new workspace and its first key (admin). */
  async createWorkspace(name: string, opts: { limits?: Record<string, number> } = {}):
      Promise<NewWorkspace> {
    return this._http.request<NewWorkspace>("POST", "/workspaces",
                                            { json: { name, limits: opts.limits ?? {} } });
  }

  /** Delete a workspace (admin): its keys revoked, its sandboxes killed (paused ones'
   * snapshots removed); its usage and audit records are kept. */
  async deleteWorkspace(workspaceId: string): Promise<WorkspaceDeleted> {
    return this._http.request<WorkspaceDeleted>(
      "DELETE", `/workspaces/${seg(workspaceId, "workspace id")}`);
  }
}
