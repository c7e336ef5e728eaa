import { useEffect, useRef, useState } from "preact/hooks"
import { get, post, request } from "../api"
import { useApp } from "../app"
import { listen, type SandboxEvent } from "../events"
import { go, href } from "../router"
import { ago, bytes, dur, idlePaused, when } from "../util"
import { Chart } from "../components/chart"
import { ErrorBox, Spinner, StateBadge, Tabs, toast, toastError, useConfirm } from "../components/ui"
import type { Sbx } from "./sandboxes"
import { TerminalTab } from "./sbx/terminal"
import { FilesTab } from "./sbx/files"
import { ProcessesTab } from "./sbx/processes"
import { PortsTab } from "./sbx/ports"
import { NetworkTab } from "./sbx/network"
import { AuditTab } from "./sbx/audit"

export interface TabProps {
  s: Sbx
  ws: string | null
  /** this sandbox's events (from the page's one event stream) */
  onEvent: (fn: (ev: SandboxEvent) => void) => () => void
}

const TABS = [
  { id: "overview", label: "Overview" }, { id: "terminal", label: "Terminal" },
  { id: "files", label: "Files" }, { id: "processes", label: "Processes" },
  { id: "ports", label: "Ports" }, { id: "network", label: "Network" }, { id: "audit", label: "Audit" },
]

export function SandboxPage({ sid, tab, ws }: { sid: string; tab: string; ws: string | null }) {
  const app = useApp()
  const wsp = app.wsParam(ws)
  const [s, setS] = useState<Sbx | null>(null)
  const [error, setError] = useState<unknown>(null)
  const [live, setLive] = useState(false)
  const subs = useRef(new Set<(ev: SandboxEvent) => void>())
  const timer = useRef<number | undefined>(undefined)
  const [confirm, confirmEl] = useConfirm()

  const load = () => get<Sbx>(`/sandboxes/${sid}`, { ws: wsp }).then((x) => { setS(x); setError(null) }).catch(setError)
  useEffect(() => {
    setS(null)
    load()
    const stop = listen(wsp, (ev) => {
      if (ev.sandbox !== sid) return
      if (ev.transition) {
        setS((cur) => (cur ? { ...cur, state: ev.kind, reason: ev.fields.reason ?? (ev.kind === "running" ? null : cur.reason) } : cur))
        clearTimeout(timer.current)
        timer.current = window.setTimeout(load, 800)
      } else if (ev.kind === "network") load()
      subs.current.forEach((fn) => fn(ev))
    }, load, setLive)
    return () => { stop(); clearTimeout(timer.current) }
  }, [sid, wsp])

  if (error) return <ErrorBox error={error} retry={load} what={`Sandbox ${sid}`} />
  if (!s) return <Spinner label={`Loading ${sid}…`} />
  const onEvent = (fn: (ev: SandboxEvent) => void) => { subs.current.add(fn); return () => { subs.current.delete(fn) } }

  const act = async (what: "pause" | "resume" | "fork" | "kill") => {
    if (what === "kill" && !(await confirm(`Kill ${sid}? Its processes, memory and files are gone for good.`))) return
    try {
      if (what === "kill") await request("DELETE", `/sandboxes/${sid}`, { ws: wsp })
      else if (what === "fork") {
        const r = await post<{ sandboxes: Sbx[] }>(`/sandboxes/${sid}/fork`, { n: 1 }, { ws: wsp })
        toast(`forked → ${r.sandboxes[0].id}`)
        go(`/sandboxes/${r.sandboxes[0].id}`, { ws: wsp })
      } else await post(`/sandboxes/${sid}/${what}`, {}, { ws: wsp })
    } catch (e) {
      toastError(e, what)
    }
  }
  const alive = ["creating", "running", "pausing", "paused", "resuming"].includes(s.state)
  const props: TabProps = { s, ws: wsp, onEvent }
  return (
    <section aria-labelledby="h-sbx">
      <nav class="crumbs" aria-label="Breadcrumb"><a href={href("/sandboxes")}>Sandboxes</a> / <span class="mono">{sid}</span></nav>
      <div class="page-head">
        <h1 id="h-sbx" class="mono">{sid}</h1>
        <StateBadge state={s.state} reason={s.reason} />
        <span class={`live ${live ? "on" : ""}`} role="status">{live ? "live" : "reconnecting…"}</span>
        <div class="head-actions">
          {s.state === "running" && <button type="button" onClick={() => act("pause")}>Pause</button>}
          {s.state === "paused" && <button type="button" onClick={() => act("resume")}>Resume</button>}
          {(s.state === "running" || idlePaused(s)) && <button type="button" onClick={() => act("fork")}>Fork</button>}
          {alive && <button type="button" class="danger" onClick={() => act("kill")}>Kill</button>}
        </div>
      </div>
      <p class="sub">{s.template} · {app.wsName(s.workspace)} · created {ago(s.created_at)}
        {s.state === "running" && s.timeout_remaining !== null ? ` · ${s.on_timeout === "pause" ? "pauses" : "ends"} in ${dur(s.timeout_remaining)}` : ""}</p>
      <Tabs tabs={TABS} current={tab} hrefOf={(t) => href(`/sandboxes/${sid}/${t}`, { ws: wsp })} />
      <div class="tab-body" role="tabpanel" aria-labelledby={`tab-${tab}`}>
        {tab === "terminal" ? <TerminalTab {...props} />
          : tab === "files" ? <FilesTab {...props} />
          : tab === "processes" ? <ProcessesTab {...props} />
          : tab === "ports" ? <PortsTab {...props} />
          : tab === "network" ? <NetworkTab {...props} />
          : tab === "audit" ? <AuditTab {...props} />
          : <Overview {...props} reload={load} />}
      </div>
      {confirmEl}
    </section>
  )
}

interface Series { t: number[]; cpu: (number | null)[]; mem: (number | null)[]; disk: (number | null)[]; rx: (number | null)[]; tx: (number | null)[] }
const POINTS = 150

function Overview({ s, ws, reload }: TabProps & { reload: () => void }) {
  const [m, setM] = useState<any>(null)
  const [series, setSeries] = useState<Series>({ t: [], cpu: [], mem: [], disk: [], rx: [], tx: [] })
  const prev = useRef<any>(null)
  const [timeout, setTimeoutV] = useState("")

  useEffect(() => {
    let stop = false
    const poll = async () => {
      if (document.hidden) return
      try {
        const x = await get<any>(`/sandboxes/${s.id}/metrics`, { ws })
        if (stop) return
        setM(x)
        if (x.state !== "running") return
        const p = prev.current
        prev.current = x
        const dt = p ? x.time - p.time : 0
        const rate = (a?: number, b?: number) => (dt > 0 && a !== undefined && b !== undefined ? Math.max(0, (a - b) / dt / 1024) : null)
        setSeries((cur) => {
          const push = <T,>(xs: T[], v: T) => [...xs, v].slice(-POINTS)
          return {
            t: push(cur.t, x.time),
            cpu: push(cur.cpu, p && dt > 0 ? Math.max(0, (100 * (x.cpu_seconds - p.cpu_seconds)) / dt) : null),
            mem: push(cur.mem, x.memory_bytes !== undefined ? x.memory_bytes / 1048576 : null),
            disk: push(cur.disk, x.disk_used_bytes !== undefined ? x.disk_used_bytes / 1048576 : null),
            rx: push(cur.rx, rate(x.net_rx_bytes, p?.net_rx_bytes)),
            tx: push(cur.tx, rate(x.net_tx_bytes, p?.net_tx_bytes)),
          }
        })
      } catch { /* shown below as no data */ }
    }
    poll()
    const t = setInterval(poll, 2000)
    return () => { stop = true; clearInterval(t) }
  }, [s.id, s.state])

  const setTo = async (e: Event) => {
    e.preventDefault()
    try {
      await post(`/sandboxes/${s.id}/timeout`, { timeout }, { ws })
      toast(`timeout set: ${timeout} from now`)
      setTimeoutV("")
      reload()
    } catch (x) { toastError(x, "timeout") }
  }
  const net = s.network
  return (
    <div class="overview">
      {s.state !== "running" && (
        <p class="note">{idlePaused(s)
          ? `Paused while idle ${ago(s.paused_at)}: nothing runs; its snapshot holds ${bytes(m?.snapshot_bytes ?? s.snapshot_bytes)}. A command, a terminal or a file call wakes it (Resume does it now); live figures return while it runs.`
          : s.state === "paused"
          ? `Paused${s.reason ? ` (${s.reason})` : ""}: nothing runs; its snapshot holds ${bytes(m?.snapshot_bytes ?? s.snapshot_bytes)}. Calls to it are refused until it is resumed; resume it to see live figures.`
          : `The sandbox is ${s.state}: live figures are shown while it runs.`}</p>
      )}
      <div class="charts">
        <Chart title={`CPU (% of one core; ${s.vcpus ?? "?"} vCPUs)`} unit="%" series={[{ label: "CPU", color: "#1f6feb" }]} data={[series.t, series.cpu]} ymax={10} fmt={(v) => `${v.toFixed(1)}%`} />
        <Chart title={`Memory (MiB of ${s.memory_mib ?? "?"})`} series={[{ label: "used", color: "#8250df" }]} data={[series.t, series.mem]} unit=" MiB" fmt={(v) => `${v.toFixed(1)} MiB`} />
        <Chart title={`Disk (MiB of ${s.disk_mib ?? "?"})`} series={[{ label: "written", color: "#bf8700" }]} data={[series.t, series.disk]} unit=" MiB" fmt={(v) => `${v.toFixed(2)} MiB`} />
        <Chart title="Network (KiB/s)" series={[{ label: "in", color: "#1a7f37" }, { label: "out", color: "#cf222e" }]} data={[series.t, series.rx, series.tx]} fmt={(v) => `${v.toFixed(2)} KiB/s`} />
      </div>
      <div class="cols">
        <dl class="facts">
          <dt>State</dt><dd>{idlePaused(s) ? "paused while idle (wakes on a call)" : `${s.state}${s.reason ? ` (${s.reason})` : ""}`}</dd>
          <dt>Template</dt><dd>{s.template}</dd>
          <dt>Size</dt><dd>{s.vcpus} vCPUs, {s.memory_mib} MiB memory, {s.disk_mib} MiB disk, {s.pids} tasks</dd>
          <dt>Tasks now</dt><dd>{m?.pids ?? "—"}</dd>
          <dt>Created</dt><dd>{when(s.created_at)}</dd>
          <dt>Timeout</dt><dd>{s.state === "running" ? `${dur(s.timeout_remaining)} left, then ${s.on_timeout}` : "—"}</dd>
          <dt>Idle timeout</dt><dd>{s.idle_timeout ? dur(s.idle_timeout) : "never"}</dd>
          <dt>Network</dt><dd>{net ? `${net.mode}${net.allow?.length ? `: ${net.allow.join(", ")}` : ""}` : "none"}</dd>
          {Object.entries(s.metadata).map(([k, v]) => <><dt>{k}</dt><dd>{v}</dd></>)}
        </dl>
        {s.state === "running" && (
          <form class="form inline" onSubmit={setTo}>
            <label>New timeout from now <input value={timeout} onInput={(e) => setTimeoutV((e.target as HTMLInputElement).value)} placeholder="30m" required /></label>
            <button type="submit">Set timeout</button>
          </form>
        )}
      </div>
    </div>
  )
}
