import uPlot from "uplot"
import "uplot/dist/uPlot.min.css"
import { useEffect, useRef } from "preact/hooks"

const clockOf = (v: number) => new Date(v * 1000).toLocaleTimeString(undefined, { hour12: false })

export interface SeriesDef { label: string; color: string; fill?: string }
const WINDOW = 60 // s: a time chart spans at least this much

/** A time series chart (uPlot): x = seconds since the epoch; one array per series. */
export function Chart({ title, series, data, height = 160, unit = "", prefix = "", bars = false, ymax, fmt, xfmt }: {
  title: string; series: SeriesDef[]; data: (number | null)[][]; height?: number; unit?: string; prefix?: string
  bars?: boolean; ymax?: number; fmt?: (v: number) => string; xfmt?: (v: number) => string
}) {
  const box = useRef<HTMLDivElement>(null)
  const plot = useRef<uPlot | null>(null)
  const fmtV = fmt ?? ((v: number) => `${+v.toFixed(2)}${unit}`)

  useEffect(() => {
    const el = box.current!
    const opts: uPlot.Options = {
      width: Math.max(200, el.clientWidth), height,
      legend: { show: true, live: true },
      cursor: { drag: { x: false, y: false } },
      scales: {
        // a time chart shows at least its last WINDOW seconds (one point would span years)
        x: bars ? { time: false } : { time: true, range: (_u, min, max) => [Math.min(min ?? max, (max ?? 0) - WINDOW), max ?? 0] },
        y: { range: (_u, _min, max) => [0, Math.max(ymax ?? 0, max || 1) * 1.1] },
      },
      axes: [
        { stroke: "currentColor", grid: { stroke: "rgba(128,128,128,.15)" }, space: 70,
          values: (_u: uPlot, vs: number[]) => vs.map(xfmt ?? clockOf) },
        { stroke: "currentColor", grid: { stroke: "rgba(128,128,128,.15)" }, size: 64,
          // ticks with as many decimals as their spacing needs, and the unit
          values: (_u: uPlot, vs: number[], _a: number, _s: number, incr: number) => {
            const dec = Math.min(6, Math.max(0, -Math.floor(Math.log10(incr || 1))))
            return vs.map((v) => `${prefix}${v.toFixed(dec)}${unit}`)
          } },
      ],
      series: [
        { label: bars ? "day" : "time", value: (_u, v) => (v == null ? "—" : (xfmt ?? clockOf)(v)) },
        ...series.map((s) => ({
          label: s.label, stroke: s.color, fill: s.fill ?? (bars ? s.color : undefined), width: bars ? 0 : 1.5,
          value: (_u: uPlot, v: number | null) => (v == null ? "—" : fmtV(v)),
          points: { show: false },
          ...(bars ? { paths: uPlot.paths.bars!({ size: [0.7, 60] }) } : {}),
        })),
      ],
    }
    const u = new uPlot(opts, data as uPlot.AlignedData, el)
    plot.current = u
    const ro = new ResizeObserver(() => u.setSize({ width: Math.max(200, el.clientWidth), height }))
    ro.observe(el)
    return () => { ro.disconnect(); u.destroy(); plot.current = null }
  }, [series.length, bars, height])

  useEffect(() => { plot.current?.setData(data as uPlot.AlignedData) }, [data])

  return (
    <figure class="chart">
      <figcaption>{title}</figcaption>
      <div ref={box} class="chart-box" role="img" aria-label={`${title} chart`} />
    </figure>
  )
}

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
