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

  /** The URL at which `port` inside is served (the path form), its token in the query (none
   * for a `public` port). A program uses it as it is (or sends the token as
   * `X-Cpuos-Token`); a browser that opens it is sent on to the port's own origin,
   * `<port>-<id>.<domain>` (`sbx.getHost`), where the token becomes a cookie of that origin
   * only: no two sandboxes or ports share an origin or a cookie. */
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
