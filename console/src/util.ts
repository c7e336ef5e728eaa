export function ago(t: number | null | undefined, now = Date.now() / 1000): string {
  if (!t) return "—"
  return dur(Math.max(0, now - t)) + " ago"
}

export function dur(s: number | null | undefined): string {
  if (s === null || s === undefined || !isFinite(s)) return "—"
  if (s < 1) return `${Math.round(s * 1000)} ms`
  if (s < 60) return `${Math.round(s)} s`
  if (s < 3600) return `${Math.floor(s / 60)} min${s % 60 >= 1 ? ` ${Math.floor(s % 60)} s` : ""}`
  if (s < 86400) return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`
  return `${Math.floor(s / 86400)} d ${Math.floor((s % 86400) / 3600)} h`
}

export function bytes(n: number | null | undefined): string {
  if (n === null || n === undefined) return "—"
  const u = ["B", "KiB", "MiB", "GiB", "TiB"]
  let i = 0
  let v = n
  while (v >= 1024 && i < u.length - 1) { v /= 1024; i++ }
  return `${v < 10 && i ? v.toFixed(1) : Math.round(v)} ${u[i]}`
}

export function usd(v: number | null | undefined): string {
  if (v === null || v === undefined) return "—"
  if (v === 0) return "$0"
  if (v < 0.01) return `$${v.toFixed(4)}`
  return `$${v.toFixed(2)}`
}

export function when(t: number | null | undefined): string {
  if (!t) return "—"
  const d = new Date(t * 1000)
  return d.toLocaleString(undefined, { hour12: false })
}

export function clock(t: number): string {
  return new Date(t * 1000).toLocaleTimeString(undefined, { hour12: false })
}

export const ACTIVE = ["creating", "running", "pausing", "paused", "resuming", "killing"]

/** Paused for idleness (its idle timeout passed with nothing to do): any call that needs the
 * machine (a command, a terminal, files, a fork) wakes it first. A sandbox paused on request
 * (or at its timeout) refuses those calls (409) until it is resumed. */
export function idlePaused(s: { state: string; reason: string | null }): boolean {
  return s.state === "paused" && s.reason === "idle"
}
