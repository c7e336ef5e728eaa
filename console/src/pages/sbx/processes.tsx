import { useEffect, useState } from "preact/hooks"
import { exec, frames, get, post, request } from "../../api"
import { bytes, dur, when } from "../../util"
import { Empty, ErrorBox, Spinner, toastError, useLoad } from "../../components/ui"
import { NotRunning } from "../../components/asleep"
import type { TabProps } from "../sandbox"

interface Cmd {
  pid: number; cmd: string; running: boolean; started_at: number | null; ended_at: number | null
  exit_code: number | null; signal: number | null; out_start: number; out_end: number
}

// what `ps` would show, from /proc (every template has python3; not every one has procps)
const PS = `import os, json
out = []
for p in os.listdir('/proc'):
    if not p.isdigit():
        continue
    try:
        st = open(f'/proc/{p}/stat').read()
        cmd = open(f'/proc/{p}/cmdline', 'rb').read().replace(b'\\0', b' ').decode(errors='replace').strip()
        r = st.rsplit(')', 1)[1].split()
        comm = st[st.index('(') + 1:st.rindex(')')]
        out.append([int(p), int(r[1]), os.stat(f'/proc/{p}').st_uid, r[0], int(r[21]) * 4096,
                    (int(r[11]) + int(r[12])) / os.sysconf('SC_CLK_TCK'), cmd or '[' + comm + ']'])
    except Exception:
        pass
print(json.dumps(sorted(out)))`

export function ProcessesTab({ s, ws }: TabProps) {
  // (only while it runs: a call for them would wake a sandbox paused for idleness)
  const cmds = useLoad((signal) => (s.state === "running"
    ? get<{ commands: Cmd[] }>(`/sandboxes/${s.id}/commands`, { ws, signal }) : Promise.resolve({ commands: [] })), [s.id, s.state])
  const [ps, setPs] = useState<{ rows: any[][] | null; busy: boolean; err: unknown }>({ rows: null, busy: false, err: null })
  const [open, setOpen] = useState<number | null>(null)
  const [cmd, setCmd] = useState("")

  if (s.state !== "running") return <NotRunning s={s} ws={ws} what="see its processes" />
  const listPs = async () => {
    setPs({ rows: ps.rows, busy: true, err: null })
    try {
      const r = await exec(s.id, ["python3", "-c", PS], ws)
      if (r.exit_code !== 0) throw new Error(r.stderr || `exit ${r.exit_code}`)
      setPs({ rows: JSON.parse(r.stdout), busy: false, err: null })
    } catch (e) { setPs({ rows: null, busy: false, err: e }) }
  }
  const start = async (e: Event) => {
    e.preventDefault()
    try {
      const r = await post<Cmd>(`/sandboxes/${s.id}/commands`, { cmd }, { ws })
      setCmd("")
      setOpen(r.pid)
      cmds.reload()
    } catch (x) { toastError(x, "start") }
  }
  const signal = async (pid: number, sig: string) => {
    try { await post(`/sandboxes/${s.id}/commands/${pid}/signal`, { signal: sig }, { ws }); setTimeout(cmds.reload, 300) } catch (x) { toastError(x, `signal ${pid}`) }
  }
  const list = cmds.data?.commands ?? []
  return (
    <div class="processes">
      <h2>Background commands</h2>
      <form class="form inline" onSubmit={start}>
        <label>Run in the background <input class="mono" value={cmd} required placeholder="python3 -m http.server 8000" onInput={(e) => setCmd((e.target as HTMLInputElement).value)} /></label>
        <button type="submit">Start</button>
        <button type="button" onClick={cmds.reload}>Refresh</button>
      </form>
      {cmds.error ? <ErrorBox error={cmds.error} retry={cmds.reload} />
        : cmds.loading && !cmds.data ? <Spinner />
        : list.length === 0 ? <Empty title="No background commands"><p>Start one above, or with <code>sbx.exec(cmd, background=True)</code>; terminals show here too.</p></Empty>
        : (
          <div class="table-wrap"><table class="list">
            <thead><tr><th scope="col">pid</th><th scope="col">Command</th><th scope="col">State</th><th scope="col" class="wide">Started</th><th scope="col"><span class="sr">Actions</span></th></tr></thead>
            <tbody>{list.map((c) => (
              <>
                <tr key={c.pid}>
                  <td class="mono">{c.pid}</td><td class="mono cmd">{c.cmd}</td>
                  <td>{c.running ? "running" : `exited ${c.exit_code ?? ""}${c.signal ? ` (signal ${c.signal})` : ""}`}</td>
                  <td class="wide">{when(c.started_at)}</td>
                  <td class="row-actions">
                    <button type="button" aria-expanded={open === c.pid} onClick={() => setOpen(open === c.pid ? null : c.pid)}>{open === c.pid ? "Hide output" : "Output"}</button>
                    {c.running && <><button type="button" onClick={() => signal(c.pid, "TERM")}>TERM</button>
                      <button type="button" class="danger" onClick={() => signal(c.pid, "KILL")}>KILL</button></>}
                  </td>
                </tr>
                {open === c.pid && <tr><td colSpan={5}><Output sid={s.id} ws={ws} pid={c.pid} running={c.running} /></td></tr>}
              </>
            ))}</tbody>
          </table></div>
        )}
      <h2>Processes</h2>
      <p class="help">Lists every process inside from <code>/proc</code> by running a short Python command (recorded in the audit trail, as any command is).</p>
      <button type="button" onClick={listPs} disabled={ps.busy}>{ps.busy ? "Listing…" : ps.rows ? "Refresh" : "List processes"}</button>
      {ps.err ? <ErrorBox error={ps.err} /> : null}
      {ps.rows && (
        <div class="table-wrap"><table class="list">
          <thead><tr><th scope="col">pid</th><th scope="col">ppid</th><th scope="col">uid</th><th scope="col">state</th><th scope="col">memory</th><th scope="col">CPU time</th><th scope="col">command</th></tr></thead>
          <tbody>{ps.rows.map((r) => <tr><td class="mono">{r[0]}</td><td class="mono">{r[1]}</td><td>{r[2]}</td><td>{r[3]}</td><td>{bytes(r[4])}</td><td>{dur(r[5])}</td><td class="mono cmd">{r[6]}</td></tr>)}</tbody>
        </table></div>
      )}
    </div>
  )
}

/** A background command's output from the oldest byte kept (followed while it runs). */
function Output({ sid, ws, pid, running }: { sid: string; ws: string | null; pid: number; running: boolean }) {
  const [text, setText] = useState("")
  const [err, setErr] = useState<unknown>(null)
  useEffect(() => {
    const ac = new AbortController()
    const dec = new TextDecoder()
    let acc = "";
    (async () => {
      try {
        const r = await request("GET", `/sandboxes/${sid}/commands/${pid}/output`, { query: { offset: 0, follow: running }, ws, signal: ac.signal })
        for await (const f of frames(r)) {
          if (f.h.t === "out") {
            acc = (acc + dec.decode(f.payload, { stream: true })).slice(-200_000)
            setText(acc)
          } else if (f.h.t === "error") throw new Error(f.h.message)
        }
      } catch (e) { if (!ac.signal.aborted) setErr(e) }
    })()
    return () => ac.abort()
  }, [sid, pid])
  return <>{err ? <ErrorBox error={err} /> : null}<pre class="code output" aria-live="off">{text || "(no output yet)"}</pre></>
}
