import { useEffect, useRef } from "preact/hooks"

/** A small line of recent values on a canvas (the sandbox list draws two per row). */
export function Sparkline({ values, max, label, color = "#1f6feb", fmt }: {
  values: number[]; max?: number; label: string; color?: string; fmt?: (v: number) => string
}) {
  const ref = useRef<HTMLCanvasElement>(null)
  useEffect(() => {
    const c = ref.current
    if (!c) return
    const dpr = window.devicePixelRatio || 1
    const w = c.clientWidth || 80, h = c.clientHeight || 22
    c.width = w * dpr
    c.height = h * dpr
    const g = c.getContext("2d")!
    g.scale(dpr, dpr)
    g.clearRect(0, 0, w, h)
    if (values.length < 2) return
    const top = Math.max(max ?? 0, ...values.map((v) => v * 1.25), 1e-9)
    const step = w / (values.length - 1)
    g.beginPath()
    values.forEach((v, i) => {
      const y = h - 1 - (Math.max(0, v) / top) * (h - 3)
      if (i) g.lineTo(i * step, y)
      else g.moveTo(0, y)
    })
    g.strokeStyle = color
    g.lineWidth = 1.5
    g.stroke()
    g.lineTo(w, h)
    g.lineTo(0, h)
    g.closePath()
    g.globalAlpha = 0.15
    g.fillStyle = color
    g.fill()
  }, [values, max])
  const last = values.length ? values[values.length - 1] : null
  const text = last === null ? "" : fmt ? fmt(last) : String(Math.round(last))
  return (
    <span class="spark-cell">
      <canvas ref={ref} class="spark" role="img" aria-label={`${label}: ${text || "no data yet"}`} />
      <span class="spark-value" aria-hidden="true">{text}</span>
    </span>
  )
}
