import { useRef, useState } from "preact/hooks"
import { get, request } from "../api"
import { useApp } from "../app"
import { tar } from "../tar"
import { bytes, dur, when } from "../util"
import { Empty, ErrorBox, Spinner, toast, useLoad } from "../components/ui"

interface Tpl { name: string; digest: string; source: string; built_at: number; build_seconds?: number; size_bytes?: number; packages?: string[]; start?: string | null }
const BUILTINS = ["python", "node", "devbox", "browser"]
const DOCKERFILE = `FROM cpuos/python
RUN pip install --no-cache-dir requests
ENV APP_ENV=dev
WORKDIR /work
`

export function TemplatesPage() {
  const app = useApp()
  const list = useLoad((signal) => get<{ templates: Tpl[] }>("/templates", { signal }), [])
  const [src, setSrc] = useState<"builtin" | "dockerfile">("builtin")
  const [builtin, setBuiltin] = useState("python")
  const [dockerfile, setDockerfile] = useState(DOCKERFILE)
  const [name, setName] = useState("")
  const [extra, setExtra] = useState<FileList | null>(null)
  const [force, setForce] = useState(false)
  const [log, setLog] = useState<string[]>([])
  const [state, setState] = useState<{ busy: boolean; result?: string; error?: unknown }>({ busy: false })
  const ac = useRef<AbortController | null>(null)
  const logEl = useRef<HTMLPreElement>(null)

  const build = async (e: Event) => {
    e.preventDefault()
    setLog([])
    setState({ busy: true })
    ac.current = new AbortController()
    const lines: string[] = []
    const push = (l: string) => {
      lines.push(l)
      setLog(lines.slice(-2000))
      requestAnimationFrame(() => { const el = logEl.current; if (el) el.scrollTop = el.scrollHeight })
    }
    try {
      let body: BodyInit | undefined
      const query: Record<string, string | boolean | undefined> = { force: force || undefined }
      if (src === "builtin") query.builtin = builtin
      else {
        const files = [{ name: "Dockerfile", data: new TextEncoder().encode(dockerfile) }]
        for (const f of Array.from(extra ?? [])) files.push({ name: f.name, data: new Uint8Array(await f.arrayBuffer()) })
        body = tar(files) as unknown as BodyInit
        query.file = "Dockerfile"
        if (name.trim()) query.name = name.trim()
      }
      const r = await request("POST", "/templates/build", { query, body, signal: ac.current.signal, headers: body ? { "Content-Type": "application/x-tar" } : {} })
      const reader = r.body!.getReader()
      const dec = new TextDecoder()
      let buf = ""
      let done = false
      while (!done) {
        const { value, done: end } = await reader.read()
        if (end) break
        buf += dec.decode(value, { stream: true })
        let i
        while ((i = buf.indexOf("\n")) >= 0) {
          const line = buf.slice(0, i)
          buf = buf.slice(i + 1)
          if (!line.trim()) continue
          const ev = JSON.parse(line)
          if (ev.log !== undefined) push(ev.log)
          else if (ev.result) {
            setState({ busy: false, result: `built ${ev.result.name} (${ev.result.digest ?? ""})${ev.result.cached ? " — cached, nothing to do" : ""}` })
            toast(`template ${ev.result.name} built`)
            done = true
          } else if (ev.error) throw Object.assign(new Error(ev.error.message), { code: ev.error.code })
          else push(JSON.stringify(ev))
        }
      }
      if (!done) throw new Error("the build's stream ended without a result (the daemon stopped it, or the connection was cut)")
      list.reload()
    } catch (x) {
      if ((x as Error).name === "AbortError") setState({ busy: false, error: new Error("build cancelled") })
      else setState({ busy: false, error: x })
    }
  }
  const items = list.data?.templates ?? []
  return (
    <section aria-labelledby="h-tpl">
      <div class="page-head"><h1 id="h-tpl">Templates</h1></div>
      {list.error ? <ErrorBox error={list.error} retry={list.reload} what="Could not list the templates" />
        : list.loading && !list.data ? <Spinner />
        : items.length === 0 ? <Empty title="No template is built"><p>Build one below, or on the host: <code>cpuos template build python</code>.</p></Empty>
        : (
          <div class="table-wrap"><table class="list">
            <thead><tr><th scope="col">Name</th><th scope="col">Source</th><th scope="col">Size</th><th scope="col" class="wide">Built</th><th scope="col" class="wide">Build time</th><th scope="col" class="wide">Starts</th></tr></thead>
            <tbody>{items.map((t) => (
              <tr key={t.name}><th scope="row">{t.name}</th><td>{t.source}</td><td>{bytes(t.size_bytes)}</td>
                <td class="wide">{when(t.built_at)}</td><td class="wide">{dur(t.build_seconds)}</td><td class="wide mono small">{t.start ?? "—"}</td></tr>
            ))}</tbody>
          </table></div>
        )}
      <h2>Build a template</h2>
      {!app.who.admin ? <p class="note">Only the admin key builds templates (they run on the daemon's host). Sign in with it to build one here.</p> : (
        <form class="form build" onSubmit={build}>
          <fieldset><legend>Source</legend>
            <label class="check"><input type="radio" name="src" checked={src === "builtin"} onChange={() => setSrc("builtin")} /> a built-in</label>
            <label class="check"><input type="radio" name="src" checked={src === "dockerfile"} onChange={() => setSrc("dockerfile")} /> a Dockerfile</label>
          </fieldset>
          {src === "builtin" ? (
            <label>Built-in <select value={builtin} onChange={(e) => setBuiltin((e.target as HTMLSelectElement).value)}>
              {BUILTINS.map((b) => <option value={b}>{b}</option>)}</select></label>
          ) : (<>
            <label>Name <input value={name} placeholder="web" pattern="[a-z0-9-]{1,64}" onInput={(e) => setName((e.target as HTMLInputElement).value)} /></label>
            <label>Dockerfile (FROM debian:bookworm or cpuos/&lt;built-in&gt;; RUN, COPY, ENV, WORKDIR, USER, CMD)
              <textarea class="mono" rows={8} value={dockerfile} onInput={(e) => setDockerfile((e.target as HTMLTextAreaElement).value)} /></label>
            <label>Files for COPY (optional) <input type="file" multiple onChange={(e) => setExtra((e.target as HTMLInputElement).files)} /></label>
          </>)}
          <label class="check"><input type="checkbox" checked={force} onChange={(e) => setForce((e.target as HTMLInputElement).checked)} /> rebuild even if cached</label>
          <div class="actions">
            {state.busy && <button type="button" onClick={() => ac.current?.abort()}>Cancel</button>}
            <button type="submit" class="primary" disabled={state.busy}>{state.busy ? "Building…" : "Build"}</button>
          </div>
        </form>
      )}
      {state.error ? <ErrorBox error={state.error} what="Build failed" /> : null}
      {state.result && <p class="ok-text" role="status">{state.result}</p>}
      {(log.length > 0 || state.busy) && <pre class="code build-log" ref={logEl} aria-live="off" aria-label="build log">{log.join("\n") || "starting…"}</pre>}
    </section>
  )
}
