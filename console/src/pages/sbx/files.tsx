import { useState } from "preact/hooks"
import { get, request, url } from "../../api"
import { bytes, when } from "../../util"
import { Empty, ErrorBox, Spinner, toast, toastError, useConfirm, useLoad } from "../../components/ui"
import { NotRunning } from "../../components/asleep"
import type { TabProps } from "../sandbox"

interface Entry { name: string; path: string; type: "file" | "dir" | "symlink" | "other"; size: number; mode: number; mtime: number; target?: string | null }
const VIEW_MAX = 1 << 20

function join(dir: string, name: string): string {
  return dir === "/" ? `/${name}` : `${dir.replace(/\/+$/, "")}/${name}`
}

export function FilesTab({ s, ws }: TabProps) {
  const [dir, setDir] = useState("/work")
  const [typed, setTyped] = useState("/work")
  const [view, setView] = useState<{ path: string; text: string | null; why?: string } | null>(null)
  const [uploading, setUploading] = useState<string | null>(null)
  const [confirm, confirmEl] = useConfirm()
  // (only while it runs: a listing would wake a sandbox paused for idleness)
  const list = useLoad((signal) => (s.state === "running"
    ? get<{ entries: Entry[] }>(`/sandboxes/${s.id}/files/list`, { query: { path: dir }, ws, signal })
    : Promise.resolve({ entries: [] as Entry[] })), [s.id, dir, s.state])

  if (s.state !== "running") return <NotRunning s={s} ws={ws} what="browse its files" />
  const cd = (p: string) => { setDir(p); setTyped(p); setView(null) }
  const parts = dir.split("/").filter(Boolean)
  const open = async (e: Entry) => {
    if (e.type === "dir") return cd(e.path)
    if (e.size > VIEW_MAX) return setView({ path: e.path, text: null, why: `${bytes(e.size)}: too large to show here; download it.` })
    try {
      const r = await request("GET", `/sandboxes/${s.id}/files`, { query: { path: e.path, max_bytes: VIEW_MAX }, ws })
      const buf = new Uint8Array(await r.arrayBuffer())
      try {
        setView({ path: e.path, text: new TextDecoder("utf-8", { fatal: true }).decode(buf) })
      } catch {
        setView({ path: e.path, text: null, why: "a binary file: download it to look at it." })
      }
    } catch (x) { toastError(x, `open ${e.path}`) }
  }
  const upload = async (files: FileList | null) => {
    if (!files?.length) return
    try {
      for (const f of Array.from(files)) {
        setUploading(f.name)
        await request("PUT", `/sandboxes/${s.id}/files`, { query: { path: join(dir, f.name) }, body: f, ws })
      }
      toast(`uploaded ${files.length} file${files.length > 1 ? "s" : ""} to ${dir}`)
    } catch (x) { toastError(x, "upload") } finally {
      setUploading(null)
      list.reload()
    }
  }
  const mkdir = async () => {
    const name = prompt("New folder name")
    if (!name) return
    try {
      await request("POST", `/sandboxes/${s.id}/files/mkdir`, { query: { path: join(dir, name) }, ws })
      list.reload()
    } catch (x) { toastError(x, "new folder") }
  }
  const remove = async (e: Entry) => {
    if (!(await confirm(`Remove ${e.path}${e.type === "dir" ? " and everything in it" : ""}?`))) return
    try {
      await request("DELETE", `/sandboxes/${s.id}/files`, { query: { path: e.path }, ws })
      list.reload()
    } catch (x) { toastError(x, `remove ${e.path}`) }
  }
  const entries = (list.data?.entries ?? []).slice().sort((a, b) => (a.type === "dir" ? 0 : 1) - (b.type === "dir" ? 0 : 1) || a.name.localeCompare(b.name))
  return (
    <div class="files">
      <div class="toolbar">
        <nav aria-label="Folder" class="path">
          <button type="button" class="link" onClick={() => cd("/")}>/</button>
          {parts.map((p, i) => <><button type="button" class="link" onClick={() => cd("/" + parts.slice(0, i + 1).join("/"))}>{p}</button>{i < parts.length - 1 ? "/" : ""}</>)}
        </nav>
        <form class="inline" onSubmit={(e) => { e.preventDefault(); cd(typed || "/") }}>
          <label><span class="sr">Go to folder</span><input class="mono" value={typed} onInput={(e) => setTyped((e.target as HTMLInputElement).value)} /></label>
          <button type="submit">Go</button>
        </form>
        <label class="button">{uploading ? `Uploading ${uploading}…` : "Upload files"}
          <input type="file" multiple class="sr" aria-label="Upload files" onChange={(e) => upload((e.target as HTMLInputElement).files)} disabled={!!uploading} /></label>
        <button type="button" onClick={mkdir}>New folder</button>
        <a class="button" href={url(`/sandboxes/${s.id}/files/tar`, { path: dir }, ws)} download={`${parts[parts.length - 1] ?? "root"}.tar`}>Download folder (tar)</a>
      </div>
      {list.error ? <ErrorBox error={list.error} retry={list.reload} what={`List ${dir}`} />
        : list.loading && !list.data ? <Spinner />
        : entries.length === 0 ? <Empty title={`${dir} is empty`}><p>Upload files here, or write them from code: <code>sbx.files.write(path, data)</code>.</p></Empty>
        : (
          <div class="table-wrap">
            <table class="list">
              <thead><tr><th scope="col">Name</th><th scope="col">Size</th><th scope="col" class="wide">Modified</th><th scope="col"><span class="sr">Actions</span></th></tr></thead>
              <tbody>
                {dir !== "/" && <tr><td colSpan={4}><button type="button" class="link" onClick={() => cd("/" + parts.slice(0, -1).join("/"))}>.. (up)</button></td></tr>}
                {entries.map((e) => (
                  <tr key={e.path} data-path={e.path}>
                    <th scope="row"><button type="button" class="link mono" onClick={() => open(e)}>{e.name}{e.type === "dir" ? "/" : ""}{e.type === "symlink" ? ` → ${e.target ?? "?"}` : ""}</button></th>
                    <td>{e.type === "dir" ? "—" : bytes(e.size)}</td>
                    <td class="wide">{when(e.mtime)}</td>
                    <td class="row-actions">
                      {e.type === "file" && <a class="button" href={url(`/sandboxes/${s.id}/files`, { path: e.path }, ws)} download={e.name} aria-label={`Download ${e.name}`}>Download</a>}
                      {e.type === "dir" && <a class="button" href={url(`/sandboxes/${s.id}/files/tar`, { path: e.path }, ws)} download={`${e.name}.tar`} aria-label={`Download ${e.name} as tar`}>tar</a>}
                      <button type="button" class="danger" onClick={() => remove(e)} aria-label={`Remove ${e.name}`}>Remove</button>
                    </td>
                  </tr>
                ))}
              </tbody>
            </table>
          </div>
        )}
      {view && (
        <section class="viewer" aria-label={`Contents of ${view.path}`}>
          <header><h3 class="mono">{view.path}</h3><button type="button" onClick={() => setView(null)}>Close</button></header>
          {view.text !== null ? <pre class="code">{view.text}</pre> : <p class="note">{view.why}</p>}
        </section>
      )}
      {confirmEl}
    </div>
  )
}
