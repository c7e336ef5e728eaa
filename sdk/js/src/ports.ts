/** `sbx.ports`: preview URLs for servers inside the sandbox (the daemon's preview proxy; a
 * request to a paused sandbox resumes it). */
import type { HttpClient } from "./http.js";
import type { PortInfo, PortList } from "./models.js";

export class Ports {
  /** @internal */
  constructor(private readonly http: HttpClient, private readonly sandboxId: string) {}

  private get base(): string {
    return `/sandboxes/${encodeURIComponent(this.sandboxId)}/ports`;
  }

  /** The URL at which `port` inside is served: with its token in the query (a browser gets
   * a cookie on first use; programs may send `X-Cpuos-Token`), or without one for a
   * `public` port. */
  async expose(port: number, opts: { public?: boolean } = {}): Promise<string> {
    const p = await this.info(port, opts);
    return p.public ? p.url : `${p.url}?cpuos_token=${p.token ?? ""}`;
  }

  /** Expose `port` (`public` undefined keeps what it was): its URLs and token. */
  async info(port: number, opts: { public?: boolean } = {}): Promise<PortInfo> {
    const json: { port: number; public?: boolean } = { port };
    if (opts.public !== undefined) json.public = opts.public;
    return this.http.request<PortInfo>("POST", this.base, { json });
  }

  async list(): Promise<PortInfo[]> {
    return (await this.http.request<PortList>("GET", this.base)).ports;
  }

  async unexpose(port: number): Promise<void> {
    await this.http.request("DELETE", `${this.base}/${port}`);
  }
}
