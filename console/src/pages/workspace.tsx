import { useState } from "preact/hooks"
import { api, get, post, request } from "../api"
import { useApp } from "../app"
import { when } from "../util"
import { Dialog, ErrorBox, Spinner, toast, toastError, useConfirm, useLoad } from "../components/ui"

interface Key { id: string; label: string; created_at: number; revoked_at: number | null; current: boolean }
const LIMITS = ["max_sandboxes", "max_vcpus", "max_memory_mib", "max_disk_mib", "max_pids", "max_total_vcpus", "max_total_memory_mib"]
const SETTINGS: [string, string, "number" | "text"][] = [
  ["spending_cap", "Spending cap (USD a month)", "number"], ["default_idle_timeout", "Default idle timeout (0: never)", "text"],
  ["default_vcpus", "Default vCPUs", "number"], ["default_memory_mib", "Default memory (MiB)", "number"],
  ["default_disk_mib", "Default disk (MiB)", "number"], ["default_pids", "Default tasks", "number"],
]

export function WorkspacePage() {
  const app = useApp()
  const wid = app.scope === "*" ? app.who.workspace.id : app.scope
  const ws = app.wsParam(wid)
  const info = useLoad((signal) => get<any>("/workspace", { ws, signal }), [wid])
  const keysPath = ws ? `/workspaces/${wid}/keys` : "/workspace/keys"
  const keys = useLoad((signal) => get<{ keys: Key[] }>(keysPath, { signal }), [wid])
  const [label, setLabel] = useState("")
  const [shownKey, setShownKey] = useState<string | null>(null)
  const [confirm, confirmEl] = useConfirm()

  const newKey = async (e: Event) => {
    e.preventDefault()
    try {
      const k = await post<{ key: string }>(keysPath, { label: label || "console" })
      setShownKey(k.key)
      setLabel("")
      keys.reload()
    } catch (x) { toastError(x, "new key") }
  }
  const revoke = async (k: Key) => {
    if (!(await confirm(`Revoke ${k.id} (${k.label})? Whatever uses it is refused from its next request${k.current ? " — including this console session" : ""}.`))) return
    try { await request("DELETE", `${keysPath}/${k.id}`); keys.reload() } catch (x) { toastError(x, "revoke") }
  }
  const d = info.data
  return (
    <section aria-labelledby="h-ws">
      <div class="page-head"><h1 id="h-ws">Workspace {d?.name ?? ""}</h1><span class="mono small">{wid}</span></div>
      {info.error ? <ErrorBox error={info.error} retry={info.reload} /> : !d ? <Spinner /> : (
        <div class="cols">
          <div>
            <h2>Limits and what is held</h2>
            <dl class="facts">
              <dt>Sandboxes alive</dt><dd>{d.used.sandboxes} of {d.limits.max_sandboxes}</dd>
              <dt>vCPUs running</dt><dd>{d.used.vcpus}{d.limits.max_total_vcpus ? ` of ${d.limits.max_total_vcpus}` : ""}</dd>
              <dt>Memory running</dt><dd>{d.used.memory_mib} MiB{d.limits.max_total_memory_mib ? ` of ${d.limits.max_total_memory_mib}` : ""}</dd>
              <dt>Per sandbox at most</dt><dd>{d.limits.max_vcpus || "host"} vCPUs, {d.limits.max_memory_mib || "host"} MiB, {d.limits.max_disk_mib} MiB disk, {d.limits.max_pids} tasks</dd>
              <dt>Settings</dt><dd>{Object.keys(d.settings ?? {}).length ? Object.entries(d.settings).map(([k, v]) => `${k}: ${typeof v === "object" ? JSON.stringify(v) : v}`).join("; ") : "the daemon's defaults"}</dd>
            </dl>
            {d.host && <details><summary>Host (as admission sees it)</summary><pre class="code">{JSON.stringify(d.host, null, 2)}</pre></details>}
          </div>
          <div>
            <h2>API keys</h2>
            {keys.error ? <ErrorBox error={keys.error} retry={keys.reload} /> : !keys.data ? <Spinner /> : (
              <div class="table-wrap"><table class="list">
                <thead><tr><th scope="col">Key</th><th scope="col">Label</th><th scope="col" class="wide">Made</th><th scope="col"><span class="sr">Actions</span></th></tr></thead>
                <tbody>{keys.data.keys.map((k) => (
                  <tr key={k.id} class={k.revoked_at ? "dim" : ""}><td class="mono">{k.id}{k.current ? " (this session)" : ""}</td><td>{k.label}</td>
                    <td class="wide">{when(k.created_at)}</td>
                    <td>{k.revoked_at ? `revoked ${when(k.revoked_at)}` : <button type="button" class="danger" onClick={() => revoke(k)}>Revoke</button>}</td></tr>
                ))}</tbody>
              </table></div>
            )}
            <form class="form inline" onSubmit={newKey}>
              <label>Label <input value={label} maxLength={64} pattern="[A-Za-z0-9 ._-]+" placeholder="ci" onInput={(e) => setLabel((e.target as HTMLInputElement).value)} /></label>
              <button type="submit">New key</button>
            </form>
          </div>
        </div>
      )}
      {app.who.admin && d && <AdminSettings key={wid} wid={wid} settings={d.settings ?? {}} effective={d.limits}
        limits={app.workspaces.find((w) => w.id === wid)?.limits ?? {}} reload={() => { info.reload(); app.reloadWorkspaces() }} />}
      {app.who.admin && <Workspaces />}
      <Dialog title="The new key" open={shownKey !== null} onClose={() => setShownKey(null)}>
        <p>Copy it now: it is shown this once (the daemon keeps only its hash).</p>
        <input class="mono wide-input" readOnly value={shownKey ?? ""} onFocus={(e) => (e.target as HTMLInputElement).select()} />
        <div class="actions">
          <button type="button" onClick={() => { navigator.clipboard?.writeText(shownKey ?? "").then(() => toast("copied"), () => undefined) }}>Copy</button>
          <button type="button" class="primary" onClick={() => setShownKey(null)}>Done</button>
        </div>
      </Dialog>
      {confirmEl}
    </section>
  )
}

/** The workspace's own settings and maxima (as set; an empty field: the default, shown as
 * its placeholder). PUT .../limits replaces the whole set, so every set one is sent. */
function AdminSettings({ wid, settings, limits, effective, reload }: {
  wid: string; settings: Record<string, any>; limits: Record<string, number>; effective: Record<string, number>; reload: () => void
}) {
  const [s, setS] = useState<Record<string, string>>(Object.fromEntries(SETTINGS.map(([k]) => [k, settings[k] === undefined ? "" : String(settings[k])])))
  const [net, setNet] = useState(settings.default_network ? (settings.default_network.allow?.length && settings.default_network.mode === "allowlist" ? settings.default_network.allow.join(",") : settings.default_network.mode) : "")
  const [l, setL] = useState<Record<string, string>>(Object.fromEntries(LIMITS.map((k) => [k, String(limits[k] ?? "")])))
  const [err, setErr] = useState<unknown>(null)
  const save = async (e: Event) => {
    e.preventDefault()
    setErr(null)
    try {
      const body: Record<string, unknown> = {}
      for (const [k, , type] of SETTINGS) body[k] = s[k].trim() === "" ? null : type === "number" ? Number(s[k]) : s[k].trim()
      body.default_network = net.trim() === "" ? null : ["off", "on", "allowlist"].includes(net.trim()) ? net.trim() : { allow: net.split(/[\s,]+/).filter(Boolean) }
      await api("PUT", `/workspaces/${wid}/settings`, { json: body })
      await api("PUT", `/workspaces/${wid}/limits`, { json: { limits: Object.fromEntries(LIMITS.filter((k) => l[k].trim() !== "").map((k) => [k, Number(l[k])])) } })
      toast("workspace settings saved")
      reload()
    } catch (x) { setErr(x) }
  }
  return (
    <form class="form settings" onSubmit={save} aria-labelledby="h-settings">
      <h2 id="h-settings">Settings and limits (admin)</h2>
      <div class="grid">
        {SETTINGS.map(([k, label, type]) => (
          <label>{label}<input type="text" inputMode={type === "number" ? "decimal" : undefined} value={s[k]} placeholder="default" onInput={(e) => setS({ ...s, [k]: (e.target as HTMLInputElement).value })} /></label>
        ))}
        <label>Default network (off, on, allowlist, or names)<input value={net} placeholder="the daemon's" onInput={(e) => setNet((e.target as HTMLInputElement).value)} /></label>
        {LIMITS.map((k) => (
          <label>{k.replace(/_/g, " ")}<input type="number" min={0} value={l[k]} placeholder={`default (${effective[k] ?? "?"})`} onInput={(e) => setL({ ...l, [k]: (e.target as HTMLInputElement).value })} /></label>
        ))}
      </div>
      {err ? <ErrorBox error={err} what="Not saved" /> : null}
      <div class="actions"><button type="submit" class="primary">Save</button></div>
    </form>
  )
}

function Workspaces() {
  const app = useApp()
  const [name, setName] = useState("")
  const [made, setMade] = useState<{ name: string; key: string } | null>(null)
  const [confirm, confirmEl] = useConfirm()
  const create = async (e: Event) => {
    e.preventDefault()
    try {
      const r = await post<{ id: string; name: string; key: string }>("/workspaces", { name })
      setMade({ name: r.name, key: r.key })
      setName("")
      app.reloadWorkspaces()
    } catch (x) { toastError(x, "new workspace") }
  }
  const remove = async (id: string, n: string) => {
    if (!(await confirm(`Delete workspace ${n}? Its keys are revoked and its sandboxes killed; its records are kept.`))) return
    try { await request("DELETE", `/workspaces/${id}`); app.reloadWorkspaces(); if (app.scope === id) app.setScope("*") } catch (x) { toastError(x, "delete workspace") }
  }
  return (
    <section aria-labelledby="h-wss">
      <h2 id="h-wss">Workspaces (admin)</h2>
      <div class="table-wrap"><table class="list">
        <thead><tr><th scope="col">Name</th><th scope="col">Id</th><th scope="col">Sandboxes</th><th scope="col">Keys</th><th scope="col"><span class="sr">Actions</span></th></tr></thead>
        <tbody>{app.workspaces.map((w) => (
          <tr key={w.id}><th scope="row"><button type="button" class="link" onClick={() => app.setScope(w.id)}>{w.name}</button></th><td class="mono">{w.id}</td>
            <td>{w.sandboxes ?? "—"}</td><td>{w.keys ?? "—"}</td>
            <td>{w.id !== app.who.workspace.id && <button type="button" class="danger" onClick={() => remove(w.id, w.name)}>Delete</button>}</td></tr>
        ))}</tbody>
      </table></div>
      <form class="form inline" onSubmit={create}>
        <label>New workspace <input value={name} required pattern="[a-z0-9-]{1,64}" placeholder="team-a" onInput={(e) => setName((e.target as HTMLInputElement).value)} /></label>
        <button type="submit">Create</button>
      </form>
      <Dialog title={`Workspace ${made?.name ?? ""} made`} open={made !== null} onClose={() => setMade(null)}>
        <p>Its first key, shown this once:</p>
        <input class="mono wide-input" readOnly value={made?.key ?? ""} onFocus={(e) => (e.target as HTMLInputElement).select()} />
        <div class="actions"><button type="button" class="primary" onClick={() => setMade(null)}>Done</button></div>
      </Dialog>
      {confirmEl}
    </section>
  )
}
