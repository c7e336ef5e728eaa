// The public API, called with the session cookie (the browser never holds the key) and,
// for requests that change something, the session's CSRF token (kept in memory only).
export class ApiError extends Error {
  constructor(public status: number, public code: string, message: string, public details: Record<string, unknown> = {}) {
    super(message)
  }
}

export interface Who {
  workspace: { id: string; name: string }
  admin: boolean
  key: { id: string; label: string | null }
  csrf: string
  expires: number
}

let csrf = ""
let onSignedOut: (why: string) => void = () => {}

export function setSession(who: Who | null): void {
  csrf = who?.csrf ?? ""
}

export function whenSignedOut(fn: (why: string) => void): void {
  onSignedOut = fn
}

export interface Opts {
  json?: unknown
  body?: BodyInit
  query?: Record<string, string | number | boolean | undefined | null | string[]>
  ws?: string | null // the workspace to act in (the admin's; null or "": the key's own)
  signal?: AbortSignal
  headers?: Record<string, string>
}

export function url(path: string, query: Opts["query"] = {}, ws?: string | null): string {
  const q = new URLSearchParams()
  for (const [k, v] of Object.entries(query ?? {})) {
    if (v === undefined || v === null) continue
    if (Array.isArray(v)) v.forEach((x) => q.append(k, x))
    else q.set(k, String(v))
  }
  if (ws) q.set("workspace", ws)
  const s = q.toString()
  return s ? `${path}?${s}` : path
}

async function errorOf(r: Response): Promise<ApiError> {
  let code = "internal"
  let message = `${r.status} ${r.statusText}`
  let details: Record<string, unknown> = {}
  try {
    const j = await r.json()
    if (j?.error) ({ code, message, details = {} } = j.error)
  } catch { /* not JSON */ }
  return new ApiError(r.status, code, message, details)
}

export async function request(method: string, path: string, opts: Opts = {}): Promise<Response> {
  const headers: Record<string, string> = { ...(opts.headers ?? {}) }
  if (!["GET", "HEAD"].includes(method)) headers["X-Cpuos-Csrf"] = csrf
  let body = opts.body
  if (opts.json !== undefined) {
    headers["Content-Type"] = "application/json"
    body = JSON.stringify(opts.json)
  }
  let r: Response
  try {
    r = await fetch(url(path, opts.query, opts.ws), {
      method, headers, body, credentials: "same-origin", signal: opts.signal, cache: "no-store",
    })
  } catch (e) {
    if ((e as Error).name === "AbortError") throw e
    throw new ApiError(0, "unreachable", "cannot reach the daemon: is cpuosd running, and is this its address?")
  }
  if (!r.ok) {
    const err = await errorOf(r)
    if (r.status === 401) onSignedOut(err.message)
    throw err
  }
  return r
}

export async function api<T = any>(method: string, path: string, opts: Opts = {}): Promise<T> {
  const r = await request(method, path, opts)
  return (await r.json()) as T
}

export const get = <T = any>(path: string, opts: Opts = {}) => api<T>("GET", path, opts)
export const post = <T = any>(path: string, json?: unknown, opts: Opts = {}) =>
  api<T>("POST", path, { ...opts, json: json ?? {} })

// ---- sign-in (cpuosd.console.routes) --------------------------------------------------
export async function signIn(key: string): Promise<Who> {
  let r: Response
  try {
    r = await fetch("/ui/session", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ key }), credentials: "same-origin", cache: "no-store",
    })
  } catch {
    throw new ApiError(0, "unreachable", "cannot reach the daemon: is cpuosd running?")
  }
  if (!r.ok) throw await errorOf(r)
  return (await r.json()) as Who
}

export async function whoAmI(): Promise<Who | null> {
  const r = await fetch("/ui/session", { credentials: "same-origin", cache: "no-store" })
  if (r.status === 401) return null
  if (!r.ok) throw await errorOf(r)
  return (await r.json()) as Who
}

export async function signOut(): Promise<void> {
  await fetch("/ui/session", {
    method: "DELETE", headers: { "X-Cpuos-Csrf": csrf }, credentials: "same-origin",
  }).catch(() => undefined)
  csrf = ""
}

// ---- frames (cpuos_agent.protocol: u32 header_len | u32 payload_len | JSON | payload) ----
export interface Frame { h: Record<string, any>; payload: Uint8Array }

export async function* frames(r: Response): AsyncGenerator<Frame> {
  const reader = r.body!.getReader()
  let buf = new Uint8Array(0)
  const dec = new TextDecoder()
  for (;;) {
    while (buf.length >= 8) {
      const dv = new DataView(buf.buffer, buf.byteOffset, buf.byteLength)
      const hl = dv.getUint32(0), pl = dv.getUint32(4)
      if (buf.length < 8 + hl + pl) break
      const h = JSON.parse(dec.decode(buf.subarray(8, 8 + hl)))
      yield { h, payload: buf.slice(8 + hl, 8 + hl + pl) }
      buf = buf.subarray(8 + hl + pl)
    }
    const { value, done } = await reader.read()
    if (done) return
    const next = new Uint8Array(buf.length + value.length)
    next.set(buf)
    next.set(value, buf.length)
    buf = next
  }
}

/** Run a command to its end (POST /sandboxes/{id}/exec): its exit code and output. */
export async function exec(sid: string, cmd: string | string[], ws?: string | null,
  timeout = "30s"): Promise<{ exit_code: number | null; stdout: string; stderr: string }> {
  const r = await request("POST", `/sandboxes/${sid}/exec`, { json: { cmd, timeout }, ws })
  const out: Uint8Array[] = [], err: Uint8Array[] = []
  let exit: number | null = null
  for await (const f of frames(r)) {
    if (f.h.t === "out") (f.h.fd === 2 ? err : out).push(f.payload)
    else if (f.h.t === "exit") exit = f.h.exit_code
    else if (f.h.t === "error") throw new ApiError(500, f.h.code, f.h.message)
  }
  const text = (xs: Uint8Array[]) => new TextDecoder().decode(concat(xs))
  return { exit_code: exit, stdout: text(out), stderr: text(err) }
}

export function concat(xs: Uint8Array[]): Uint8Array {
  const n = xs.reduce((a, x) => a + x.length, 0)
  const out = new Uint8Array(n)
  let o = 0
  for (const x of xs) { out.set(x, o); o += x.length }
  return out
}
