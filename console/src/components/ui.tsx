import type { ComponentChildren, JSX } from "preact"
import { useCallback, useEffect, useRef, useState } from "preact/hooks"
import { ApiError } from "../api"

export function Spinner({ label = "Loading…" }: { label?: string }) {
  return <div class="loading" role="status" aria-live="polite"><span class="spin" aria-hidden="true" />{label}</div>
}

/** An error that says what happened and what to do; ``retry`` offers to try again. */
export function ErrorBox({ error, retry, what }: { error: unknown; retry?: () => void; what?: string }) {
  const e = error as ApiError
  const hint = hintFor(e)
  return (
    <div class="error" role="alert">
      <strong>{what ? `${what}: ` : ""}{e?.message ?? String(error)}</strong>
      {hint && <p>{hint}</p>}
      {retry && <button type="button" onClick={retry}>Try again</button>}
    </div>
  )
}

export function hintFor(e: ApiError | undefined): string | null {
  switch (e?.code) {
    case "unreachable": return "Check that cpuosd is running and reachable at this address, then try again."
    case "not_found": return "It may have ended, or belong to another workspace. Go back to the list."
    case "conflict": return "The sandbox is not in a state that allows this right now; wait for it to settle."
    case "limit_exceeded": return "A limit of the workspace or of the host was reached: end or pause sandboxes, or ask the admin to raise it."
    case "spending_cap": return "The workspace reached its spending cap: the admin can raise it on the Workspace page."
    case "permission_denied": return "Your key may not do this: sign in with the admin key."
    case "unavailable": return "The sandbox stopped answering; it may be paused or ending."
    case "invalid_argument": return "Correct the value named above and submit again."
    default: return null
  }
}

export function Empty({ title, children }: { title: string; children?: ComponentChildren }) {
  return <div class="empty"><p class="empty-title">{title}</p>{children}</div>
}

const STATE_CLASS: Record<string, string> = {
  running: "ok", paused: "idle", creating: "busy", resuming: "busy", pausing: "busy",
  killing: "busy", killed: "off", error: "bad",
}

export function StateBadge({ state, reason }: { state: string; reason?: string | null }) {
  return (
    <span class={`badge state-${STATE_CLASS[state] ?? "off"}`} data-state={state}
      title={reason ? `${state} (${reason})` : state}>
      {state}{reason && state !== "running" ? <span class="reason"> · {reason}</span> : null}
    </span>
  )
}

export function Dialog({ title, open, onClose, children }: {
  title: string; open: boolean; onClose: () => void; children: ComponentChildren
}) {
  const ref = useRef<HTMLDialogElement>(null)
  useEffect(() => {
    const d = ref.current
    if (!d) return
    if (open && !d.open) d.showModal()
    if (!open && d.open) d.close()
  }, [open])
  return (
    <dialog ref={ref} aria-label={title} onClose={onClose} onCancel={onClose}>
      <header class="dialog-head"><h2>{title}</h2>
        <button type="button" class="icon" aria-label="Close" onClick={onClose}>×</button></header>
      {open && children}
    </dialog>
  )
}

/** Confirm before something that cannot be undone. */
export function useConfirm(): [(msg: string) => Promise<boolean>, JSX.Element] {
  const [ask, setAsk] = useState<{ msg: string; done: (v: boolean) => void } | null>(null)
  const confirm = useCallback((msg: string) => new Promise<boolean>((done) => setAsk({ msg, done })), [])
  const end = (v: boolean) => { ask?.done(v); setAsk(null) }
  const el = (
    <Dialog title="Are you sure?" open={ask !== null} onClose={() => end(false)}>
      <p>{ask?.msg}</p>
      <div class="actions">
        <button type="button" onClick={() => end(false)}>Cancel</button>
        <button type="button" class="danger" autofocus onClick={() => end(true)}>Yes, do it</button>
      </div>
    </Dialog>
  )
  return [confirm, el]
}

export interface TabDef { id: string; label: string }

/** Tabs as links (the route holds the tab), with arrow keys between them. */
export function Tabs({ tabs, current, hrefOf }: { tabs: TabDef[]; current: string; hrefOf: (id: string) => string }) {
  const onKey = (e: KeyboardEvent) => {
    if (e.key !== "ArrowRight" && e.key !== "ArrowLeft") return
    const i = tabs.findIndex((t) => t.id === current)
    const j = (i + (e.key === "ArrowRight" ? 1 : tabs.length - 1)) % tabs.length
    location.hash = hrefOf(tabs[j].id)
    e.preventDefault()
    requestAnimationFrame(() => document.getElementById(`tab-${tabs[j].id}`)?.focus())
  }
  return (
    <nav class="tabs" role="tablist" aria-label="Sandbox views" onKeyDown={onKey}>
      {tabs.map((t) => (
        <a id={`tab-${t.id}`} role="tab" href={hrefOf(t.id)} aria-selected={t.id === current}
          tabIndex={t.id === current ? 0 : -1} class={t.id === current ? "current" : ""}>{t.label}</a>
      ))}
    </nav>
  )
}

/** Data loaded by ``load``, reloaded when ``deps`` change or on ``reload()``. */
export function useLoad<T>(load: (signal: AbortSignal) => Promise<T>, deps: unknown[]): {
  data: T | undefined; error: unknown; loading: boolean; reload: () => void; set: (v: T) => void
} {
  const [data, setData] = useState<T | undefined>(undefined)
  const [error, setError] = useState<unknown>(null)
  const [loading, setLoading] = useState(true)
  const [n, setN] = useState(0)
  useEffect(() => {
    const ac = new AbortController()
    setLoading(true)
    load(ac.signal).then((v) => { if (!ac.signal.aborted) { setData(v); setError(null) } })
      .catch((e) => { if (!ac.signal.aborted) setError(e) })
      .finally(() => { if (!ac.signal.aborted) setLoading(false) })
    return () => ac.abort()
  }, [...deps, n])
  return { data, error, loading, reload: () => setN((x) => x + 1), set: setData }
}

/** A short message at the bottom of the window (results and errors of actions). */
let pushToast: (t: Toast) => void = () => {}
interface Toast { id: number; text: string; bad: boolean }
let toastId = 0

export function toast(text: string, bad = false): void {
  pushToast({ id: ++toastId, text, bad })
}

export function toastError(e: unknown, what: string): void {
  const err = e as ApiError
  const hint = hintFor(err)
  toast(`${what}: ${err?.message ?? String(e)}${hint ? ` — ${hint}` : ""}`, true)
}

export function Toasts() {
  const [items, setItems] = useState<Toast[]>([])
  useEffect(() => {
    pushToast = (t) => {
      setItems((xs) => [...xs.slice(-4), t])
      setTimeout(() => setItems((xs) => xs.filter((x) => x.id !== t.id)), t.bad ? 9000 : 4000)
    }
  }, [])
  return (
    <div class="toasts" role="status" aria-live="polite">
      {items.map((t) => <div class={`toast ${t.bad ? "bad" : ""}`} key={t.id}>{t.text}</div>)}
    </div>
  )
}

export function isApiError(e: unknown): e is ApiError {
  return e instanceof ApiError
}
