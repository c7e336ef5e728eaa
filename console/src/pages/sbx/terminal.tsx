import { useEffect, useRef, useState } from "preact/hooks"
import { get, post } from "../../api"
import type { TermStatus } from "../../components/terminal"
import { ErrorBox, Spinner, toastError, useLoad } from "../../components/ui"
import { NotRunning } from "../../components/asleep"
import type { TabProps } from "../sandbox"

// the terminal each sandbox page had open: a tab switch or a reload of the list reattaches
const attached = new Map<string, number>()

interface Cmd { pid: number; cmd: string; running: boolean; started_at: number | null; exit_code: number | null }

type TermModule = typeof import("../../components/terminal")
let loaded: TermModule | null = null

export function TerminalTab({ s, ws }: TabProps) {
  // xterm.js is most of the bundle: loaded when a terminal is first wanted
  const [mod, setMod] = useState<TermModule | null>(loaded)
  useEffect(() => {
    if (!mod) import("../../components/terminal").then((m) => { loaded = m; setMod(m) })
  }, [])
  const [pid, setPid] = useState<number | null>(attached.get(s.id) ?? null)
  const [key, setKey] = useState(0)
  const [status, setStatus] = useState<{ s: TermStatus; d?: string }>({ s: "connecting" })
  const [busy, setBusy] = useState(false)
  const area = useRef<HTMLDivElement>(null)
  const cmds = useLoad((signal) => (s.state === "running"
    ? get<{ commands: Cmd[] }>(`/sandboxes/${s.id}/commands`, { ws, signal }) : Promise.resolve({ commands: [] })), [s.id, s.state, pid])

  if (s.state !== "running" && pid === null) return <NotRunning s={s} ws={ws} what="open a terminal" />
  const open = async () => {
    setBusy(true)
    try {
      const { cols, rows } = mod ? mod.measure(area.current) : { cols: 100, rows: 30 }
      const r = await post<{ pid: number }>(`/sandboxes/${s.id}/pty`, { cols, rows }, { ws })
      attached.set(s.id, r.pid)
      setPid(r.pid)
      setKey((k) => k + 1)
    } catch (e) {
      toastError(e, "new terminal")
    } finally {
      setBusy(false)
    }
  }
  const attach = (p: number) => { attached.set(s.id, p); setPid(p); setKey((k) => k + 1) }
  const detach = () => { attached.delete(s.id); setPid(null) }
  const running = (cmds.data?.commands ?? []).filter((c) => c.running)
  return (
    <div class="terminal-tab">
      <div class="toolbar">
        <button type="button" class="primary" onClick={open} disabled={busy}>{busy ? "Opening…" : "New terminal"}</button>
        {pid !== null && <>
          <span class="status" role="status">terminal {pid}: {status.s}{status.d ? ` — ${status.d}` : ""}</span>
          <button type="button" onClick={() => setKey((k) => k + 1)}>Reattach</button>
          <button type="button" onClick={detach}>Detach</button>
        </>}
        {running.length > 0 && (
          <label>Attach to <select value={pid ?? ""} onChange={(e) => { const v = (e.target as HTMLSelectElement).value; if (v) attach(Number(v)) }}>
            <option value="">…</option>
            {running.map((c) => <option value={c.pid}>{c.pid}: {c.cmd.slice(0, 40)}</option>)}
          </select></label>
        )}
      </div>
      {cmds.error ? <ErrorBox error={cmds.error} retry={cmds.reload} /> : null}
      <div class="term-area" ref={area}>
        {pid !== null && !mod ? <Spinner label="Loading the terminal…" />
          : pid !== null && mod
          ? <mod.TermView sid={s.id} ws={ws} pid={pid} attachKey={key} onStatus={(st, d) => setStatus({ s: st, d })} />
          : cmds.loading ? <Spinner /> : <p class="help">Open a terminal: a login shell inside the sandbox. It keeps running when you detach or leave this page; attach to it again from here. Keys typed here go to the terminal; Tab moves focus only outside it.</p>}
      </div>
    </div>
  )
}
