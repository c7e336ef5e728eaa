import { useState } from "preact/hooks"
import { ApiError, get, post } from "../api"
import { useApp } from "../app"
import { ErrorBox, useLoad } from "../components/ui"
import type { Sbx } from "./sandboxes"

export function networkValue(mode: string, allow: string): unknown {
  if (mode === "custom") {
    return { allow: allow.split(/[\s,]+/).map((x) => x.trim()).filter(Boolean) }
  }
  return mode
}

export function CreateForm({ onDone }: { onDone: (s: Sbx | null) => void }) {
  const app = useApp()
  const [ws, setWs] = useState(app.scope === "*" ? app.who.workspace.id : app.scope)
  const tpls = useLoad((signal) => get<{ templates: { name: string }[] }>("/templates", { signal }), [])
  const [f, setF] = useState({ template: "python", vcpus: "", memory: "", disk: "", timeout: "15m",
    idle: "", on_timeout: "kill", network: "", allow: "" })
  const [busy, setBusy] = useState(false)
  const [err, setErr] = useState<unknown>(null)
  const set = (k: keyof typeof f) => (e: Event) => setF({ ...f, [k]: (e.target as HTMLInputElement).value })
  const num = (v: string) => (v.trim() ? Number(v) : undefined)

  const submit = async (e: Event) => {
    e.preventDefault()
    setBusy(true)
    setErr(null)
    try {
      const body: Record<string, unknown> = {
        template: f.template, timeout: f.timeout || undefined, on_timeout: f.on_timeout,
        vcpus: num(f.vcpus), memory_mib: num(f.memory), disk_mib: num(f.disk),
        idle_timeout: f.idle.trim() || undefined,
        network: f.network ? networkValue(f.network, f.allow) : undefined,
      }
      const s = await post<Sbx>("/sandboxes", body, { ws: app.wsParam(ws) })
      onDone(s)
    } catch (x) {
      setErr(x)
    } finally {
      setBusy(false)
    }
  }
  const field = (x: ApiError | null, name: string) => (x?.details as any)?.field === name || (x?.message ?? "").startsWith(name)
  const e = err as ApiError | null
  return (
    <form class="form create" onSubmit={submit}>
      {app.who.admin && (
        <label>Workspace
          <select value={ws} onChange={(ev) => setWs((ev.target as HTMLSelectElement).value)}>
            {app.workspaces.map((w) => <option value={w.id}>{w.name}</option>)}
          </select>
        </label>
      )}
      <label>Template
        <select value={f.template} onChange={set("template")} required>
          {(tpls.data?.templates ?? [{ name: "python" }]).map((t) => <option value={t.name}>{t.name}</option>)}
        </select>
      </label>
      <div class="row3">
        <label>vCPUs <input type="number" min={1} max={64} placeholder="default" value={f.vcpus} onInput={set("vcpus")} aria-invalid={field(e, "vcpus") || undefined} /></label>
        <label>Memory (MiB) <input type="number" min={128} step={128} placeholder="default" value={f.memory} onInput={set("memory")} aria-invalid={field(e, "memory_mib") || undefined} /></label>
        <label>Disk (MiB) <input type="number" min={64} step={256} placeholder="default" value={f.disk} onInput={set("disk")} aria-invalid={field(e, "disk_mib") || undefined} /></label>
      </div>
      <div class="row3">
        <label>Timeout <input value={f.timeout} onInput={set("timeout")} placeholder="15m" aria-describedby="h-dur" aria-invalid={field(e, "timeout") || undefined} /></label>
        <label>At the timeout <select value={f.on_timeout} onChange={set("on_timeout")}>
          <option value="kill">kill</option><option value="pause">pause</option></select></label>
        <label>Idle timeout <input value={f.idle} onInput={set("idle")} placeholder="default (0: never)" aria-describedby="h-dur" aria-invalid={field(e, "idle_timeout") || undefined} /></label>
      </div>
      <p id="h-dur" class="help">Durations: <code>90s</code>, <code>15m</code>, <code>2h</code>. A size other than the default boots cold (slower).</p>
      <label>Network
        <select value={f.network} onChange={set("network")}>
          <option value="">workspace default</option>
          <option value="off">off: nothing leaves</option>
          <option value="allowlist">allowlist: the package registries</option>
          <option value="custom">allowlist: these names…</option>
          <option value="on">on: anything outside the deny sets</option>
        </select>
      </label>
      {f.network === "custom" && (
        <label>Allowed names (one per line; <code>*.example.com</code> for subdomains)
          <textarea rows={3} value={f.allow} onInput={set("allow")} placeholder="pypi.org&#10;*.github.com" /></label>
      )}
      {err ? <ErrorBox error={err} what="Not created" /> : null}
      <div class="actions">
        <button type="button" onClick={() => onDone(null)}>Cancel</button>
        <button type="submit" class="primary" disabled={busy}>{busy ? "Creating…" : "Create"}</button>
      </div>
    </form>
  )
}
