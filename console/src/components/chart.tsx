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
        // a time chart shows at least the last WINDOW seconds of its data, from the data
        // itself (uPlot widens a single point to a thousand days; none yet: 1970), or the
        // minute up to now while there is none
        x: bars ? { time: false } : { time: true, range: (u) => {
          const xs = (u.data?.[0] ?? []) as number[]
          const hi = xs.length ? xs[xs.length - 1] : Date.now() / 1000
          return [Math.min(xs.length ? xs[0] : hi, hi - WINDOW), hi]
        } },
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
