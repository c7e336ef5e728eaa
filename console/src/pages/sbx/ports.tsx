import { useEffect, useState } from "preact/hooks"
import { get, post, request } from "../../api"
import { when } from "../../util"
import { Empty, ErrorBox, Spinner, toastError, useLoad } from "../../components/ui"
import type { TabProps } from "../sandbox"

interface Port { port: number; public: boolean; url: string; host_url: string; created_at: number; token?: string }

export function PortsTab({ s, ws, onEvent }: TabProps) {
  const ports = useLoad((signal) => get<{ ports: Port[] }>(`/sandboxes/${s.id}/ports`, { ws, signal }), [s.id])
  const [port, setPort] = useState("")
  const [pub, setPub] = useState(false)
  useEffect(() => onEvent((ev) => { if (ev.kind === "port" && ev.fields.action !== "connect") ports.reload() }), [])
  const expose = async (e: Event) => {
    e.preventDefault()
    try {
      await post(`/sandboxes/${s.id}/ports`, { port: Number(port), public: pub }, { ws })
      setPort("")
      ports.reload()
    } catch (x) { toastError(x, `expose ${port}`) }
  }
  const unexpose = async (p: number) => {
    try { await request("DELETE", `/sandboxes/${s.id}/ports/${p}`, { ws }); ports.reload() } catch (x) { toastError(x, `unexpose ${p}`) }
  }
  const list = ports.data?.ports ?? []
  return (
    <div class="ports">
      <form class="form inline" onSubmit={expose}>
        <label>Port <input type="number" min={1} max={65535} required value={port} onInput={(e) => setPort((e.target as HTMLInputElement).value)} /></label>
        <label class="check"><input type="checkbox" checked={pub} onChange={(e) => setPub((e.target as HTMLInputElement).checked)} /> public (no token)</label>
        <button type="submit">Expose</button>
      </form>
      {ports.error ? <ErrorBox error={ports.error} retry={ports.reload} />
        : ports.loading && !ports.data ? <Spinner />
        : list.length === 0 ? <Empty title="No port exposed"><p>Start a server inside (e.g. <code>python3 -m http.server 8000</code> under Processes), then expose its port here to get a preview link.</p></Empty>
        : (
          <div class="table-wrap"><table class="list">
            <thead><tr><th scope="col">Port</th><th scope="col">Preview</th><th scope="col">Access</th><th scope="col" class="wide">Since</th><th scope="col"><span class="sr">Actions</span></th></tr></thead>
            <tbody>{list.map((p) => (
              <tr key={p.port}>
                <td class="mono">{p.port}</td>
                <td><a href={p.host_url + (p.public || !p.token ? "" : `?cpuos_token=${encodeURIComponent(p.token)}`)} target="_blank" rel="noopener noreferrer">{p.host_url}</a>
                  <br /><a class="small" href={p.url + (p.public || !p.token ? "" : `?cpuos_token=${encodeURIComponent(p.token)}`)} target="_blank" rel="noopener noreferrer">path form</a></td>
                <td>{p.public ? "public" : "token"}</td>
                <td class="wide">{when(p.created_at)}</td>
                <td><button type="button" class="danger" onClick={() => unexpose(p.port)} aria-label={`Unexpose ${p.port}`}>Unexpose</button></td>
              </tr>
            ))}</tbody>
          </table></div>
        )}
    </div>
  )
}
