import { useState } from "preact/hooks"
import { get } from "../api"
import { useApp } from "../app"
import { href } from "../router"
import { dur, usd } from "../util"
import { Chart } from "../components/chart"
import { Empty, ErrorBox, Spinner, useLoad } from "../components/ui"

interface Figures { running_seconds: number; vcpu_seconds: number; memory_gib_seconds: number; paused_seconds: number; idle_paused_seconds: number; snapshot_gib_seconds: number; cost: number }
interface Usage {
  since: number; until: number; prices: Record<string, number>; currency: string; total: Figures
  sandboxes: (Figures & { id: string })[]; spending_cap: { cap: number | null; month_spent: number; reached: boolean }
  days: (Figures & { date: string })[]
}

export function UsagePage() {
  const app = useApp()
  const [days, setDays] = useState(30)
  const ws = app.scope === "*" ? app.who.workspace.id : app.scope
  const since = (() => {
    const d = new Date()
    d.setUTCHours(0, 0, 0, 0)
    return Math.floor(d.getTime() / 1000) - (days - 1) * 86400
  })()
  const u = useLoad((signal) => get<Usage>("/usage", { query: { by: "day", since }, ws: app.wsParam(ws), signal }), [ws, days])
  const d = u.data
  const x = d ? d.days.map((_, i) => i) : []
  const label = (i: number) => (d?.days[Math.round(i)]?.date ?? "").slice(5)
  const cap = d?.spending_cap
  return (
    <section aria-labelledby="h-usage">
      <div class="page-head">
        <h1 id="h-usage">Usage{app.who.admin ? `: ${app.wsName(ws)}` : ""}</h1>
        <label>Period <select value={days} onChange={(e) => setDays(Number((e.target as HTMLSelectElement).value))}>
          <option value={7}>7 days</option><option value={30}>30 days</option><option value={90}>90 days</option></select></label>
      </div>
      {app.scope === "*" && <p class="help">Usage is per workspace: showing {app.wsName(ws)}; pick another in the Workspace menu above.</p>}
      {u.error ? <ErrorBox error={u.error} retry={u.reload} what="Could not load the usage" />
        : !d ? <Spinner />
        : (<>
          <div class="cap" aria-label="spending this month">
            <p>This month: <strong>{usd(cap!.month_spent)}</strong>{cap!.cap !== null ? <> of a <strong>{usd(cap!.cap)}</strong> cap</> : " (no spending cap)"}
              {cap!.reached ? <span class="badge state-bad"> cap reached: create and resume are refused</span> : null}</p>
            {cap!.cap !== null && <meter min={0} max={cap!.cap || 1} value={cap!.month_spent} low={(cap!.cap || 1) * 0.7} high={(cap!.cap || 1) * 0.9} optimum={0} aria-label="spent of the cap" />}
            <p class="help">Prices: {usd(d.prices.vcpu_hour)} a vCPU-hour, {usd(d.prices.gib_hour)} a GiB-hour of memory, {usd(d.prices.snapshot_gib_hour)} a GiB-hour of snapshot. In these {days} days: {usd(d.total.cost)}, {dur(d.total.running_seconds)} running, {dur(d.total.paused_seconds)} paused.</p>
          </div>
          <div class="charts">
            <Chart title="vCPU-hours a day" bars series={[{ label: "vCPU-h", color: "#1f6feb" }]} data={[x, d.days.map((v) => v.vcpu_seconds / 3600)]} xfmt={label} fmt={(v) => v.toFixed(2)} />
            <Chart title="Memory GiB-hours a day" bars series={[{ label: "GiB-h", color: "#8250df" }]} data={[x, d.days.map((v) => v.memory_gib_seconds / 3600)]} xfmt={label} fmt={(v) => v.toFixed(2)} />
            <Chart title="Snapshot storage GiB-hours a day" bars series={[{ label: "GiB-h", color: "#bf8700" }]} data={[x, d.days.map((v) => v.snapshot_gib_seconds / 3600)]} xfmt={label} fmt={(v) => v.toFixed(3)} />
            <Chart title="Cost a day (USD)" bars series={[{ label: "USD", color: "#1a7f37" }]} data={[x, d.days.map((v) => v.cost)]} xfmt={label} prefix="$" fmt={(v) => `$${v.toFixed(v < 1 ? 4 : 2)}`} />
          </div>
          <h2>By sandbox</h2>
          {d.sandboxes.length === 0 ? <Empty title="Nothing used in this period" /> : (
            <div class="table-wrap"><table class="list">
              <thead><tr><th scope="col">Sandbox</th><th scope="col">Running</th><th scope="col">Paused</th><th scope="col" class="wide">vCPU-h</th><th scope="col" class="wide">GiB-h</th><th scope="col">Cost</th></tr></thead>
              <tbody>{d.sandboxes.slice().sort((a, b) => b.cost - a.cost).slice(0, 200).map((s) => (
                <tr key={s.id}><th scope="row"><a class="mono" href={href(`/sandboxes/${s.id}`, { ws: app.wsParam(ws) })}>{s.id}</a></th>
                  <td>{dur(s.running_seconds)}</td><td>{dur(s.paused_seconds)}</td><td class="wide">{(s.vcpu_seconds / 3600).toFixed(3)}</td>
                  <td class="wide">{(s.memory_gib_seconds / 3600).toFixed(3)}</td><td>{usd(s.cost)}</td></tr>
              ))}</tbody>
            </table></div>
          )}
        </>)}
    </section>
  )
}
