import { useEffect, useState } from "preact/hooks"
import { get } from "../../api"
import { bytes, clock, when } from "../../util"
import { Empty, ErrorBox, Spinner } from "../../components/ui"
import type { TabProps } from "../sandbox"

interface Row { seq: number; time: number; kind: string; detail: Record<string, any>; hash: string }
const KINDS = ["command", "file_write", "connection", "lifecycle", "limit", "port", "dropped"]
const MAX_ROWS = 5000

export function summary(r: Row): string {
  const d = r.detail
  switch (r.kind) {
    case "command": {
      const what = d.shell ?? (Array.isArray(d.argv) ? d.argv.join(" ") : d.binary ?? "")
      const tail = d.exit_code !== undefined && d.exit_code !== null ? ` → exit ${d.exit_code}` : d.signal ? ` → signal ${d.signal}` : ""
      return `${d.background ? "[background] " : ""}${what}${tail}`
    }
    case "file_write": return `${d.path ?? ""}${d.size !== undefined ? ` (${bytes(d.size)})` : ""}`
    case "connection": return `${d.verdict ?? "?"} ${d.proto ?? ""} ${d.name ?? d.dst ?? "?"}${d.port ? `:${d.port}` : ""}${d.rule ? ` — ${d.rule}` : ""}`
    case "lifecycle":
      if (d.event === "network") return `network policy → ${d.network?.mode ?? "?"}${d.network?.allow?.length ? ` (${d.network.allow.join(", ")})` : ""}`
      if (d.event) return `${d.event}`
      return `${d.from ?? "—"} → ${d.to}${d.reason ? ` (${d.reason})` : ""}`
    case "limit": return `${d.limit ?? "limit"}${d.exit_code !== undefined ? `: command ended (${d.exit_code})` : ""}${d.reason ? ` — ${d.reason}` : ""}`
    case "port": return `${d.action ?? ""} port ${d.port ?? "?"}${d.peer ? ` from ${d.peer}` : ""}`
    case "dropped": return `${d.count ?? "?"} row(s) not recorded (${d.source ?? ""})`
    default: return JSON.stringify(d)
  }
}

export function AuditTab({ s, ws }: TabProps) {
  const [kinds, setKinds] = useState<string[]>([])
  const [rows, setRows] = useState<Row[] | null>(null)
  const [err, setErr] = useState<unknown>(null)
  const [verify, setVerify] = useState<{ ok: boolean; problem_count?: number; problems?: any[] } | "checking" | null>(null)
  const [open, setOpen] = useState<number | null>(null)
  const [n, setN] = useState(0)

  useEffect(() => {
    const ac = new AbortController()
    let after = 0
    let acc: Row[] = []
    setRows(null)
    setErr(null);
    (async () => {
      // the rows so far, then every new one as it is recorded (long poll: wait=25)
      for (let first = true; !ac.signal.aborted; first = false) {
        try {
          const r = await get<{ rows: Row[]; next_after: number }>(`/sandboxes/${s.id}/audit`, {
            query: { after, kind: kinds.length ? kinds : undefined, limit: 1000, wait: first ? 0 : 25 }, ws, signal: ac.signal,
          })
          after = r.next_after
          if (r.rows.length || first) {
            acc = [...acc, ...r.rows].slice(-MAX_ROWS)
            setRows(acc)
          }
          setErr(null)
          if (r.rows.length === 1000) continue
        } catch (e) {
          if (ac.signal.aborted) return
          setErr(e)
          await new Promise((ok) => setTimeout(ok, 3000))
        }
      }
    })()
    return () => ac.abort()
  }, [s.id, kinds.join(","), n])

  const check = () => {
    setVerify("checking")
    get("/audit/verify", { ws }).then(setVerify).catch((e) => { setVerify(null); setErr(e) })
  }
  useEffect(check, [s.id])
  const toggle = (k: string) => setKinds(kinds.includes(k) ? kinds.filter((x) => x !== k) : [...kinds, k])
  const shown = (rows ?? []).slice().reverse()
  return (
    <div class="audit">
      <div class="toolbar">
        <fieldset class="kinds"><legend>Kinds</legend>
          {KINDS.map((k) => <label class="check"><input type="checkbox" checked={kinds.includes(k)} onChange={() => toggle(k)} /> {k}</label>)}
        </fieldset>
        <span class={`badge chain ${verify === "checking" || verify === null ? "" : verify.ok ? "state-ok" : "state-bad"}`} role="status" data-chain={verify && verify !== "checking" ? (verify.ok ? "ok" : "broken") : "checking"}>
          {verify === "checking" || verify === null ? "checking the chain…"
            : verify.ok ? "✓ chain verified" : `✗ chain broken: ${verify.problem_count ?? verify.problems?.length ?? "?"} problem(s)`}
        </span>
        <button type="button" onClick={check}>Verify again</button>
        <a class="button" href={`/sandboxes/${s.id}/audit/export${ws ? `?workspace=${encodeURIComponent(ws)}` : ""}`} download={`${s.id}-audit.jsonl`}>Export (JSON lines)</a>
      </div>
      {err ? <ErrorBox error={err} retry={() => setN((x) => x + 1)} what="Audit trail" /> : null}
      {rows === null ? <Spinner label="Loading the audit trail…" />
        : shown.length === 0 ? <Empty title="Nothing recorded yet"><p>Commands, file writes, connections, lifecycle changes and limits appear here as they happen.</p></Empty>
        : (
          <div class="table-wrap"><table class="list audit-rows">
            <thead><tr><th scope="col">#</th><th scope="col">Time</th><th scope="col">Kind</th><th scope="col">What</th></tr></thead>
            <tbody>{shown.map((r) => (
              <>
                <tr key={r.seq} data-kind={r.kind}>
                  <td class="mono">{r.seq}</td><td class="nowrap" title={when(r.time)}>{clock(r.time)}</td>
                  <td><span class={`badge kind-${r.kind}`}>{r.kind}</span>{r.detail.source ? <span class="small"> {r.detail.source}</span> : null}</td>
                  <td><button type="button" class={`link mono what ${open === r.seq ? "" : "clamp"}`} aria-expanded={open === r.seq} onClick={() => setOpen(open === r.seq ? null : r.seq)}>{summary(r)}</button></td>
                </tr>
                {open === r.seq && <tr><td colSpan={4}><pre class="code">{JSON.stringify({ ...r.detail, hash: r.hash }, null, 2)}</pre></td></tr>}
              </>
            ))}</tbody>
          </table></div>
        )}
    </div>
  )
}
