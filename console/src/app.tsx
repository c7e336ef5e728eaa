import { createContext } from "preact"
import { useContext, useEffect, useState } from "preact/hooks"
import { get, setSession, signOut, whenSignedOut, whoAmI, type Who } from "./api"
import { closeAll } from "./events"
import { href, useRoute } from "./router"
import { ErrorBox, Spinner, Toasts } from "./components/ui"
import { SignIn } from "./pages/signin"
import { SandboxesPage } from "./pages/sandboxes"

// the list is the first page; the others (with uPlot) load when one is first opened, or
// once the browser is idle after the first page is up (not while it is being drawn)
type Pages = typeof import("./pages/lazy")
let pages: Pages | null = null
function useLazyPages(wanted: boolean): Pages | null {
  const [p, setP] = useState<Pages | null>(pages)
  useEffect(() => {
    if (p) return
    const load = () => import("./pages/lazy").then((m) => { pages = m; setP(m) })
    if (wanted) { load(); return }
    const idle = window.requestIdleCallback ?? ((f: () => void) => window.setTimeout(f, 2000))
    const t = window.setTimeout(() => idle(load, { timeout: 5000 }), 1500)
    return () => clearTimeout(t)
  }, [wanted])
  return p
}

export interface Workspace { id: string; name: string; sandboxes?: number; keys?: number; settings?: Record<string, any>; limits?: Record<string, number> }

export interface Ctx {
  who: Who
  /** the admin's choice: "*" every workspace, or one's id; others: their own */
  scope: string
  setScope: (s: string) => void
  workspaces: Workspace[]
  reloadWorkspaces: () => void
  /** the workspace parameter for a call in workspace ``w`` (none when it is the key's own) */
  wsParam: (w?: string | null) => string | null
  wsName: (w: string) => string
}

export const AppCtx = createContext<Ctx>(null as unknown as Ctx)
export const useApp = () => useContext(AppCtx)

export function App() {
  const [who, setWho] = useState<Who | null | undefined>(undefined)
  const [error, setError] = useState<unknown>(null)
  const [signedOutWhy, setSignedOutWhy] = useState<string | null>(null)

  const check = () => {
    setError(null)
    whoAmI().then((w) => { setSession(w); setWho(w) }).catch(setError)
  }
  useEffect(() => {
    check()
    whenSignedOut((why) => {
      closeAll()
      setSession(null)
      setWho(null)
      setSignedOutWhy(why)
    })
  }, [])

  if (error) return <main class="center"><ErrorBox error={error} retry={check} what="Could not load the console" /></main>
  if (who === undefined) return <main class="center"><Spinner /></main>
  if (who === null) {
    return <><SignIn why={signedOutWhy} onSignedIn={(w) => { setSession(w); setSignedOutWhy(null); setWho(w) }} /><Toasts /></>
  }
  return <Signed who={who} onSignOut={async () => { closeAll(); await signOut(); setSession(null); setWho(null) }} />
}

const NAV = [["sandboxes", "Sandboxes"], ["templates", "Templates"], ["usage", "Usage"], ["workspace", "Workspace"]]

function Signed({ who, onSignOut }: { who: Who; onSignOut: () => void }) {
  const route = useRoute()
  const [scope, setScope] = useState(who.admin ? "*" : who.workspace.id)
  const [workspaces, setWorkspaces] = useState<Workspace[]>([{ id: who.workspace.id, name: who.workspace.name }])
  const [n, setN] = useState(0)
  useEffect(() => {
    if (!who.admin) return
    get<{ workspaces: Workspace[] }>("/workspaces").then((r) => setWorkspaces(r.workspaces)).catch(() => undefined)
  }, [n])
  const ctx: Ctx = {
    who, scope, setScope, workspaces, reloadWorkspaces: () => setN((x) => x + 1),
    wsParam: (w) => (w && w !== who.workspace.id ? w : null),
    wsName: (w) => workspaces.find((x) => x.id === w)?.name ?? w,
  }
  const page = route.parts[0] ?? "sandboxes"
  const first = page === "sandboxes" && !route.parts[1]
  const lazy = useLazyPages(!first)
  let body
  if (first) body = <SandboxesPage />
  else if (!lazy) body = <Spinner />
  else if (page === "sandboxes") {
    body = <lazy.SandboxPage sid={route.parts[1]} tab={route.parts[2] ?? "overview"} ws={route.query.get("ws")} />
  } else if (page === "templates") body = <lazy.TemplatesPage />
  else if (page === "usage") body = <lazy.UsagePage />
  else if (page === "workspace") body = <lazy.WorkspacePage />
  else body = <SandboxesPage />
  return (
    <AppCtx.Provider value={ctx}>
      <a class="skip" href="#main" onClick={(e) => { e.preventDefault(); document.getElementById("main")?.focus() }}>Skip to content</a>
      <header class="top">
        <a class="brand" href={href("/sandboxes")}>cpuos</a>
        <nav class="main-nav" aria-label="Main">
          {NAV.map(([id, label]) => (
            <a href={href(`/${id}`)} aria-current={page === id ? "page" : undefined}>{label}</a>
          ))}
        </nav>
        <div class="who">
          {who.admin && (
            <label class="scope">
              <span>Workspace</span>
              <select value={scope} onChange={(e) => setScope((e.target as HTMLSelectElement).value)}>
                <option value="*">All workspaces</option>
                {workspaces.map((w) => <option value={w.id}>{w.name}</option>)}
              </select>
            </label>
          )}
          <span class="whoami" title={`key ${who.key.id}`}>{who.workspace.name}{who.admin ? " (admin)" : ""}</span>
          <button type="button" onClick={onSignOut}>Sign out</button>
        </div>
      </header>
      <main id="main" tabIndex={-1}>{body}</main>
      <Toasts />
    </AppCtx.Provider>
  )
}
