import { useEffect, useRef } from "preact/hooks"

// the canvas's CSS size (style.css .spark): known here, so drawing reads no layout (200
// canvases each reading its size would lay the whole list out 200 times)
const W = 90, H = 22

/** A small line of recent values on a canvas (the sandbox list draws two per row). */
export function Sparkline({ values, max, label, color = "#1f6feb", fmt }: {
  values: number[]; max?: number; label: string; color?: string; fmt?: (v: number) => string
}) {
  const ref = useRef<HTMLCanvasElement>(null)
  const drawn = useRef(false)
  useEffect(() => {
    const c = ref.current
    // nothing to draw (the first paint: no figures yet) and nothing drawn: leave it be
    if (!c || (values.length < 2 && !drawn.current)) return
    const dpr = window.devicePixelRatio || 1
    c.width = W * dpr
    c.height = H * dpr
    const g = c.getContext("2d")!
    g.scale(dpr, dpr)
    g.clearRect(0, 0, W, H)
    drawn.current = values.length >= 2
    if (!drawn.current) return
    const top = Math.max(max ?? 0, ...values.map((v) => v * 1.25), 1e-9)
    const step = W / (values.length - 1)
    g.beginPath()
    values.forEach((v, i) => {
      const y = H - 1 - (Math.max(0, v) / top) * (H - 3)
      if (i) g.lineTo(i * step, y)
      else g.moveTo(0, y)
    })
    g.strokeStyle = color
    g.lineWidth = 1.5
    g.stroke()
    g.lineTo(W, H)
    g.lineTo(0, H)
    g.closePath()
    g.globalAlpha = 0.15
    g.fillStyle = color
    g.fill()
  }, [values, max])
  const last = values.length ? values[values.length - 1] : null
  const text = last === null ? "" : fmt ? fmt(last) : String(Math.round(last))
  return (
    <span class="spark-cell">
      <canvas ref={ref} class="spark" width={W} height={H} role="img" aria-label={`${label}: ${text || "no data yet"}`} />
      <span class="spark-value" aria-hidden="true">{text}</span>
    </span>
  )
}
