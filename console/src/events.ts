// The daemon's event bus as server-sent events (GET /events): one EventSource per scope
// (the key's workspace, one the admin acts in, or "*"), shared by every view that listens.
import { url } from "./api"

export interface SandboxEvent {
  kind: string
  sandbox: string
  workspace: string
  previous: string | null
  time: number
  transition: boolean
  fields: Record<string, any>
}

type Listener = (ev: SandboxEvent) => void
type StatusListener = (live: boolean) => void

export const KINDS = ["creating", "running", "pausing", "paused", "resuming", "killing", "killed",
  "error", "command", "connection", "file_write", "idle", "limit", "network", "oom", "port"]

class Stream {
  es: EventSource | null = null
  listeners = new Set<Listener>()
  resyncs = new Set<() => void>()
  statuses = new Set<StatusListener>()
  live = false

  constructor(public scope: string) {}

  open(): void {
    const es = new EventSource(url("/events", {}, this.scope || null), { withCredentials: true })
    this.es = es
    es.addEventListener("hello", () => {
      this.setLive(true)
      this.resyncs.forEach((fn) => fn()) // (re)connected: what we missed is in the state now
    })
    for (const k of KINDS) {
      es.addEventListener(k, (m) => {
        // "error" is also the name of EventSource's own connection-error event (a plain
        // Event, no data): only a message from the daemon carries a sandbox event
        if (!(m instanceof MessageEvent) || typeof m.data !== "string") return
        const ev = JSON.parse(m.data) as SandboxEvent
        this.listeners.forEach((fn) => fn(ev))
      })
    }
    es.addEventListener("overflow", () => this.resyncs.forEach((fn) => fn()))
    es.onerror = () => {
      this.setLive(false)
      if (es.readyState === EventSource.CLOSED) { // (a 401: signed out) retry later
        setTimeout(() => { if (this.es === es && this.listeners.size) this.open() }, 3000)
      }
    }
  }

  setLive(v: boolean): void {
    this.live = v
    this.statuses.forEach((fn) => fn(v))
  }

  close(): void {
    this.es?.close()
    this.es = null
  }
}

const streams = new Map<string, Stream>()

/** Listen to the events of a scope; returns the function that stops listening. */
export function listen(scope: string | null, fn: Listener, resync?: () => void,
  status?: StatusListener): () => void {
  const key = scope ?? ""
  let s = streams.get(key)
  if (!s) {
    s = new Stream(key)
    streams.set(key, s)
    s.open()
  }
  const st = s
  st.listeners.add(fn)
  if (resync) st.resyncs.add(resync)
  if (status) { st.statuses.add(status); status(st.live) }
  return () => {
    st.listeners.delete(fn)
    if (resync) st.resyncs.delete(resync)
    if (status) st.statuses.delete(status)
    if (!st.listeners.size) {
      st.close()
      streams.delete(key)
    }
  }
}

export function closeAll(): void {
  streams.forEach((s) => s.close())
  streams.clear()
}
