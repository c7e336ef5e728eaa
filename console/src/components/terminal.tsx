import { Terminal } from "@xterm/xterm"
import { FitAddon } from "@xterm/addon-fit"
import "@xterm/xterm/css/xterm.css"
import { useEffect, useRef, useState } from "preact/hooks"
import { url } from "../api"

export type TermStatus = "connecting" | "attached" | "detached" | "exited" | "error"

/** A terminal of the sandbox (a pty command, ``pid``) over its WebSocket
 * (``/sandboxes/{id}/pty/{pid}/ws``): the output it kept is replayed on attach, keys go in
 * as binary messages, the size follows the element's. */
export function TermView({ sid, ws, pid, attachKey, onStatus }: {
  sid: string; ws: string | null; pid: number; attachKey: number
  onStatus: (s: TermStatus, detail?: string) => void
}) {
  const box = useRef<HTMLDivElement>(null)
  const [, setTick] = useState(0)

  useEffect(() => {
    const term = new Terminal({
      cursorBlink: true, fontSize: 13, scrollback: 5000, convertEol: false,
      fontFamily: "ui-monospace, SFMono-Regular, Menlo, Consolas, monospace",
      theme: { background: "#0d1117", foreground: "#e6edf3" },
    })
    const fit = new FitAddon()
    term.loadAddon(fit)
    term.open(box.current!)
    const doFit = () => { try { fit.fit() } catch { /* not laid out yet */ } }
    doFit()
    const proto = location.protocol === "https:" ? "wss" : "ws"
    const sock = new WebSocket(`${proto}://${location.host}${url(`/sandboxes/${sid}/pty/${pid}/ws`, { offset: 0 }, ws)}`)
    sock.binaryType = "arraybuffer"
    const enc = new TextEncoder()
    let ended = false
    onStatus("connecting")
    sock.onopen = () => {
      sock.send(JSON.stringify({ type: "resize", cols: term.cols, rows: term.rows }))
    }
    sock.onmessage = (m) => {
      if (typeof m.data !== "string") {
        term.write(new Uint8Array(m.data as ArrayBuffer))
        return
      }
      const j = JSON.parse(m.data)
      if (j.type === "attached") onStatus("attached")
      else if (j.type === "exit") {
        ended = true
        term.write(`\r\n\x1b[2m[exited${j.exit_code !== null && j.exit_code !== undefined ? ` with code ${j.exit_code}` : ""}${j.signal ? `, signal ${j.signal}` : ""}]\x1b[0m\r\n`)
        onStatus("exited")
      } else if (j.type === "error") {
        ended = true
        term.write(`\r\n\x1b[31m[${j.message}]\x1b[0m\r\n`)
        onStatus("error", j.message)
      }
    }
    sock.onclose = (e) => {
      if (!ended) onStatus(e.code === 1000 ? "detached" : "error", e.reason || (e.code !== 1000 ? `connection closed (${e.code})` : undefined))
    }
    const d1 = term.onData((d) => { if (sock.readyState === WebSocket.OPEN) sock.send(enc.encode(d)) })
    const d2 = term.onBinary((d) => {
      if (sock.readyState === WebSocket.OPEN) sock.send(Uint8Array.from(d, (c) => c.charCodeAt(0)))
    })
    const d3 = term.onResize(({ cols, rows }) => {
      if (sock.readyState === WebSocket.OPEN) sock.send(JSON.stringify({ type: "resize", cols, rows }))
    })
    const ro = new ResizeObserver(() => doFit())
    ro.observe(box.current!)
    term.focus()
    setTick((x) => x + 1)
    return () => {
      ro.disconnect(); d1.dispose(); d2.dispose(); d3.dispose()
      sock.onclose = null
      sock.close(1000)
      term.dispose()
    }
  }, [sid, ws, pid, attachKey])

  return <div ref={box} class="term" aria-label={`terminal ${pid}`} />
}

/** cols x rows a terminal of this element's size would have (before one is made). */
export function measure(el: HTMLElement | null): { cols: number; rows: number } {
  if (!el) return { cols: 100, rows: 30 }
  const cw = 7.8, ch = 17 // the font above, roughly; the terminal is resized once attached
  return { cols: Math.max(20, Math.floor((el.clientWidth - 16) / cw)), rows: Math.max(8, Math.floor((el.clientHeight - 8) / ch)) }
}
