import { useEffect, useRef, useState } from "preact/hooks"
import { get, post } from "../../api"
import { bytes, clock } from "../../util"
import { Empty, ErrorBox, Spinner, toast, toastError, useLoad } from "../../components/ui"
import { networkValue } from "../create"
import type { TabProps } from "../sandbox"

interface Conn { n: number; time: number; proto: string; dst?: string; port?: number; name?: string; verdict: string; rule?: string; bytes_out?: number; bytes_in?: number; reason?: string }

export function NetworkTab({ s, ws, onEvent }: TabProps) {
  const conns = useLoad((signal) => get<{ connections: Conn[] }>(`/sandboxes/${s.id}/connections`, { query: { limit: 500 }, ws, signal }), [s.id])
  const [verdict, setVerdict] = useState("")
  const cur = s.network
  const [mode, setMode] = useState(cur?.mode === "allowlist" && cur.allow?.length ? "custom" : cur?.mode ?? "off")
  const [allow, setAllow] = useState((cur?.allow ?? []).join("\n"))
  const timer = useRef<number | undefined>(undefined)
  useEffect(() => onEvent((ev) => {
    if (ev.kind !== "connection") return
    clearTimeout(timer.current)
    timer.current = window.setTimeout(conns.reload, 300)
  }), [])
  const apply = async (e: Event) => {
    e.preventDefault()
    try {
      await post(`/sandboxes/${s.id}/network`, { network: networkValue(mode, allow) }, { ws })
      toast("network policy changed: new connections follow it")
    } catch (x) { toastError(x, "network policy") }
  }
  const rows = (conns.data?.connections ?? []).filter((c) => !verdict || c.verdict === verdict)
  return (
    <div class="network">
      <form class="form policy" onSubmit={apply}>
        <p>Policy now: <strong>{cur ? cur.mode : "none"}</strong>{cur?.allow?.length ? `: ${cur.allow.join(", ")}` : ""}.
          Private ranges, the metadata address and SMTP are refused in every mode.</p>
        <label>Egress <select value={mode} onChange={(e) => setMode((e.target as HTMLSelectElement).value)}>
          <option value="off">off: nothing leaves</option>
          <option value="allowlist">allowlist: the package registries</option>
          <option value="custom">allowlist: these names…</option>
          <option value="on">on: anything outside the deny sets</option>
        </select></label>
        {mode === "custom" && <label>Allowed names (one per line)
          <textarea rows={3} value={allow} onInput={(e) => setAllow((e.target as HTMLTextAreaElement).value)} /></label>}
        <button type="submit" disabled={s.state !== "running" && s.state !== "paused"}>Apply</button>
      </form>
      <div class="toolbar section">
        <h2>Connections</h2>
        <label>Verdict <select value={verdict} onChange={(e) => setVerdict((e.target as HTMLSelectElement).value)}>
          <option value="">any</option><option value="allowed">allowed</option><option value="denied">denied</option><option value="error">error</option>
        </select></label>
        <button type="button" onClick={conns.reload}>Refresh</button>
      </div>
      {conns.error ? <ErrorBox error={conns.error} retry={conns.reload} />
        : conns.loading && !conns.data ? <Spinner />
        : rows.length === 0 ? <Empty title="No connections recorded"><p>Every outbound attempt from inside, allowed or not, shows here as it happens.</p></Empty>
        : (
          <div class="table-wrap"><table class="list connections">
            <thead><tr><th scope="col">Time</th><th scope="col">Proto</th><th scope="col">Destination</th><th scope="col">Verdict</th><th scope="col" class="wide">Rule</th><th scope="col" class="wide">Bytes out / in</th></tr></thead>
            <tbody>{rows.map((c) => (
              <tr key={c.n} data-verdict={c.verdict}>
                <td>{clock(c.time)}</td><td>{c.proto}</td>
                <td class="mono">{c.name ?? c.dst ?? "?"}{c.port ? `:${c.port}` : ""}{c.name && c.dst ? <span class="small"> {c.dst}</span> : null}</td>
                <td><span class={`badge verdict-${c.verdict}`}>{c.verdict}</span></td>
                <td class="wide">{c.rule ?? ""}{c.reason ? ` — ${c.reason}` : ""}</td>
                <td class="wide">{bytes(c.bytes_out ?? 0)} / {bytes(c.bytes_in ?? 0)}</td>
              </tr>
            ))}</tbody>
          </table></div>
        )}
    </div>
  )
}
