// Routing on the URL's fragment (#/sandboxes/<id>/files?ws=...): the daemon serves one page.
import { useEffect, useState } from "preact/hooks"

export interface Route { parts: string[]; query: URLSearchParams; hash: string }

export function parse(hash: string = location.hash): Route {
  const h = hash.replace(/^#/, "") || "/sandboxes"
  const [path, qs] = h.split("?", 2)
  return { parts: path.split("/").filter(Boolean).map(decodeURIComponent), query: new URLSearchParams(qs ?? ""), hash: h }
}

export function useRoute(): Route {
  const [r, setR] = useState(parse())
  useEffect(() => {
    const on = () => setR(parse())
    addEventListener("hashchange", on)
    return () => removeEventListener("hashchange", on)
  }, [])
  return r
}

export function href(path: string, query: Record<string, string | null | undefined> = {}): string {
  const q = new URLSearchParams()
  for (const [k, v] of Object.entries(query)) if (v) q.set(k, v)
  const s = q.toString()
  return `#${path}${s ? `?${s}` : ""}`
}

export function go(path: string, query: Record<string, string | null | undefined> = {}): void {
  location.hash = href(path, query)
}
