import { useEffect, useMemo, useRef, useState } from "preact/hooks"
import { get, post, request } from "../api"
import { useApp } from "../app"
import { listen, type SandboxEvent } from "../events"
import { href } from "../router"
import { ACTIVE, ago, bytes, dur, idlePaused, usd } from "../util"
import { Sparkline } from "../components/sparkline"
import { Dialog, Empty, ErrorBox, Spinner, StateBadge, toast, toastError, useConfirm } from "../components/ui"
import { CreateForm } from "./create"

export interface Sbx {
  id: string; workspace: string; template: string; state: string; reason: string | null
  created_at: number; started_at: number | null; ended_at: number | null; deadline: number | null
  timeout_remaining: number | null; vcpus: number | null; memory_mib: number | null
  pids: number | null; disk_mib: number | null; network: { mode: string; allow: string[] } | null
  metadata: Record<string, string>; on_timeout: string; paused_at: number | null
  node_id?: string | null // (many hosts: the node holding it; null on one host, or in the snapshot store)
  snapshot_bytes: number | null; idle_timeout: number
}

interface Hist { cpu: number[]; mem: number[]; last?: { t: number; cpu: number } }
const SAMPLES = 40
const METRICS_EVERY = 3000
const COST_EVERY = 20000

export function SandboxesPage() {
  const app = useApp()
  const scope = app.scope
  const wsq = scope === "*" ? "*" : app.wsParam(scope)
  const [rows, setRows] = useState<Map<string, Sbx> | null>(null)
  const [error, setError] = useState<unknown>(null)
  const [live, setLive] = useState(false)
  const [showEnded, setShowEnded] = useState(false)
  const [q, setQ] = useState("")
  const [stateF, setStateF] = useState("active")
  const [tplF, setTplF] = useState("")
  const [hist, setHist] = useState<Map<string, Hist>>(new Map())
  const [costs, setCosts] = useState<Map<string, number>>(new Map())
  const [creating, setCreating] = useState(false)
  const [, tick] = useState(0)
  const [confirm, confirmEl] = useConfirm()
  const resyncTimer = useRef<number | undefined>(undefined)
  const rowsRef = useRef(rows)
  rowsRef.current = rows

  const load = async () => {
    try {
      const r = await get<{ sandboxes: Sbx[] }>("/sandboxes", { query: { all: showEnded || undefined }, ws: wsq })
      setRows(new Map(r.sandboxes.map((s) => [s.id, s])))
      setError(null)
    } catch (e) {
      setError(e)
    }
  }
  const resyncSoon = () => {
    clearTimeout(resyncTimer.current)
    resyncTimer.current = window.setTimeout(load, 1500)
  }

  useEffect(() => {
    setRows(null)
    load()
    const onEvent = (ev: SandboxEvent) => {
      if (!ev.transition) return
      setRows((prev) => {
        if (!prev) return prev
        const cur = prev.get(ev.sandbox)
        const next = new Map(prev)
        if (cur) next.set(ev.sandbox, { ...cur, state: ev.kind, reason: ev.fields.reason ?? (ev.kind === "running" ? null : cur.reason) })
        else if (ev.kind !== "killed" && ev.kind !== "error") {
          // new here (a create, a fork, a pooled one handed out): its row
          get<Sbx>(`/sandboxes/${ev.sandbox}`, { ws: app.wsParam(ev.workspace) })
            .then((s) => setRows((p) => (p ? new Map(p).set(s.id, s) : p))).catch(() => undefined)
          return prev
        } else return prev
        return next
      })
      resyncSoon()
    }
    const stop = listen(wsq, onEvent, load, setLive)
    const t = setInterval(() => tick((x) => x + 1), 10000)
    return () => { stop(); clearInterval(t); clearTimeout(resyncTimer.current) }
  }, [wsq, showEnded])

  // CPU and memory of each running sandbox, for the sparklines (GET /metrics): once the
  // list is on the screen (the first paint waits for nothing else)
  const listed = rows !== null
  useEffect(() => {
    if (!listed) return
    let stop = false
    const poll = async () => {
      if (document.hidden) return
      try {
        const r = await get<{ sandboxes: any[] }>("/metrics", { ws: wsq })
        if (stop) return
        setHist((prev) => {
          const next = new Map<string, Hist>()
          for (const m of r.sandboxes) {
            const h: Hist = prev.get(m.id) ?? { cpu: [], mem: [] }
            const nh: Hist = { cpu: h.cpu, mem: h.mem, last: h.last }
            if (m.state === "running" && typeof m.cpu_seconds === "number") {
              if (h.last && m.time > h.last.t) {
                const pct = (100 * (m.cpu_seconds - h.last.cpu)) / (m.time - h.last.t)
                nh.cpu = [...h.cpu, Math.max(0, pct)].slice(-SAMPLES)
              }
              nh.last = { t: m.time, cpu: m.cpu_seconds }
              if (typeof m.memory_bytes === "number") nh.mem = [...h.mem, m.memory_bytes].slice(-SAMPLES)
            }
            next.set(m.id, nh)
          }
          return next
        })
      } catch { /* the list shows errors; sparklines wait */ }
    }
    const first = setTimeout(poll, 200)
    const t = setInterval(poll, METRICS_EVERY)
    return () => { stop = true; clearTimeout(first); clearInterval(t) }
  }, [wsq, listed])

  // cost so far of each sandbox (GET /usage, per workspace shown)
  useEffect(() => {
    let stop = false
    const poll = async () => {
      const cur = rowsRef.current
      if (!cur || !cur.size || document.hidden) return
      const byWs = new Map<string, number>()
      for (const s of cur.values()) byWs.set(s.workspace, Math.min(byWs.get(s.workspace) ?? Infinity, s.created_at))
      const out = new Map<string, number>()
      await Promise.all([...byWs].map(async ([w, since]) => {
        try {
          const u = await get<{ sandboxes: { id: string; cost: number }[] }>("/usage", { query: { since: Math.floor(since) - 1 }, ws: app.wsParam(w) })
          for (const s of u.sandboxes) out.set(s.id, s.cost)
        } catch { /* shown as — */ }
      }))
      if (!stop) setCosts(out)
    }
    const first = setTimeout(poll, 600)
    const t = setInterval(poll, COST_EVERY)
    return () => { stop = true; clearTimeout(first); clearInterval(t) }
  }, [wsq, listed])

  const all = rows ? [...rows.values()] : []
  const templates = useMemo(() => [...new Set(all.map((s) => s.template))].sort(), [rows])
  const nodes = all.some((s) => s.node_id) // (several hosts: the node column)
  const shown = all.filter((s) => {
    if (tplF && s.template !== tplF) return false
    if (stateF === "active" && !ACTIVE.includes(s.state)) return false
    if (stateF === "running" && s.state !== "running") return false
    if (stateF === "paused" && s.state !== "paused") return false
    if (stateF === "ended" && ACTIVE.includes(s.state)) return false
    if (q) {
      const hay = [s.id, s.template, s.state, s.reason ?? "", s.node_id ?? "", app.wsName(s.workspace), ...Object.values(s.metadata)].join(" ").toLowerCase()
      if (!hay.includes(q.toLowerCase())) return false
    }
    return true
  }).sort((a, b) => b.created_at - a.created_at)

  const act = async (s: Sbx, what: "pause" | "resume" | "fork" | "kill") => {
    if (what === "kill" && !(await confirm(`Kill ${s.id}? Its processes, memory and files are gone for good.`))) return
    try {
      const opts = { ws: app.wsParam(s.workspace) }
      if (what === "kill") await request("DELETE", `/sandboxes/${s.id}`, opts)
      else if (what === "fork") {
        const r = await post<{ sandboxes: Sbx[] }>(`/sandboxes/${s.id}/fork`, { n: 1 }, opts)
        toast(`forked ${s.id} → ${r.sandboxes.map((x) => x.id).join(", ")}`)
      } else await post(`/sandboxes/${s.id}/${what}`, {}, opts)
    } catch (e) {
      toastError(e, `${what} ${s.id}`)
    }
  }

  return (
    <section aria-labelledby="h-sandboxes">
      <div class="page-head">
        <h1 id="h-sandboxes">Sandboxes</h1>
        <span class={`live ${live ? "on" : ""}`} role="status" title="updated from the daemon's event stream">
          {live ? "live" : "reconnecting…"}</span>
        <button type="button" class="primary" onClick={() => setCreating(true)}>New sandbox</button>
      </div>
      <div class="filters" role="search">
        <label><span class="sr">Search</span>
          <input type="search" placeholder="Search id, template, metadata…" value={q}
            onInput={(e) => setQ((e.target as HTMLInputElement).value)} /></label>
        <label>State <select value={stateF} onChange={(e) => setStateF((e.target as HTMLSelectElement).value)}>
          <option value="active">alive</option><option value="running">running</option>
          <option value="paused">paused</option><option value="ended">ended</option><option value="">any</option>
        </select></label>
        <label>Template <select value={tplF} onChange={(e) => setTplF((e.target as HTMLSelectElement).value)}>
          <option value="">any</option>{templates.map((t) => <option value={t}>{t}</option>)}
        </select></label>
        <label class="check"><input type="checkbox" checked={showEnded}
          onChange={(e) => { const v = (e.target as HTMLInputElement).checked; setShowEnded(v); if (v && stateF === "active") setStateF("") }} /> include ended</label>
      </div>
      {error ? <ErrorBox error={error} retry={load} what="Could not list the sandboxes" />
        : rows === null ? <Spinner label="Loading sandboxes…" />
        : all.length === 0 ? (
          <Empty title="No sandboxes yet">
            <p>Create one with <strong>New sandbox</strong>, or from code: <code>Sandbox.create(template="python")</code>.</p>
          </Empty>
        ) : shown.length === 0 ? (
          <Empty title="No sandbox matches these filters"><button type="button" onClick={() => { setQ(""); setStateF(""); setTplF("") }}>Clear filters</button></Empty>
        ) : (
          <div class="table-wrap">
            <table class="list sandboxes" data-nodes={nodes ? "yes" : undefined}>
              <caption class="sr">{shown.length} sandboxes</caption>
              <thead><tr>
                <th scope="col">Sandbox</th><th scope="col">State</th><th scope="col">Template</th>
                {scope === "*" && <th scope="col" class="wide">Workspace</th>}
                {nodes && <th scope="col" class="wide">Node</th>}
                <th scope="col">Age</th><th scope="col" class="wide">CPU</th><th scope="col" class="wide">Memory</th>
                <th scope="col" class="wide">Idle / paused</th><th scope="col">Cost</th><th scope="col"><span class="sr">Actions</span></th>
              </tr></thead>
              <tbody>
                {shown.map((s) => {
                  const h = hist.get(s.id)
                  const link = href(`/sandboxes/${s.id}`, { ws: app.wsParam(s.workspace) })
                  const alive = ACTIVE.includes(s.state)
                  return (
                    <tr key={s.id} data-sid={s.id} data-state={s.state}>
                      <th scope="row"><a href={link} class="mono">{s.id}</a></th>
                      <td><StateBadge state={s.state} reason={s.reason} /></td>
                      <td>{s.template}</td>
                      {scope === "*" && <td class="wide">{app.wsName(s.workspace)}</td>}
                      {nodes && <td class="wide mono" data-node={s.node_id ?? undefined}>{s.node_id ?? "—"}</td>}
                      <td class="nowrap" title={new Date(s.created_at * 1000).toLocaleString()}>{ago(s.created_at)}</td>
                      <td class="wide"><Sparkline values={h?.cpu ?? []} max={5} label={`CPU of ${s.id}`} fmt={(v) => `${v < 10 ? v.toFixed(1) : Math.round(v)}%`} /></td>
                      <td class="wide"><Sparkline values={h?.mem ?? []} max={64 << 20} color="#8250df" label={`memory of ${s.id}`} fmt={bytes} /></td>
                      <td class="wide" data-idle={idlePaused(s) ? "asleep" : undefined}>{idlePaused(s) ? `asleep ${ago(s.paused_at)}; wakes on a call` : s.state === "paused" ? `paused ${ago(s.paused_at)}` : s.state === "running" ? (s.idle_timeout ? `pauses after ${dur(s.idle_timeout)} idle` : "never pauses") : "—"}</td>
                      <td>{usd(costs.get(s.id))}</td>
                      <td class="row-actions">
                        {s.state === "running" && <button type="button" onClick={() => act(s, "pause")} aria-label={`Pause ${s.id}`}>Pause</button>}
                        {s.state === "paused" && <button type="button" onClick={() => act(s, "resume")} aria-label={`Resume ${s.id}`}>Resume</button>}
                        {(s.state === "running" || idlePaused(s)) && <button type="button" onClick={() => act(s, "fork")} aria-label={`Fork ${s.id}`}>Fork</button>}
                        {alive && <button type="button" class="danger" onClick={() => act(s, "kill")} aria-label={`Kill ${s.id}`}>Kill</button>}
                      </td>
                    </tr>
                  )
                })}
              </tbody>
            </table>
          </div>
        )}
      <Dialog title="New sandbox" open={creating} onClose={() => setCreating(false)}>
        <CreateForm onDone={(s) => {
          setCreating(false)
          if (s) {
            setRows((p) => (p ? new Map(p).set(s.id, s) : p))
            toast(`created ${s.id}`)
          }
        }} />
      </Dialog>
      {confirmEl}
    </section>
  )
}
