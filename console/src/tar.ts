// A ustar archive of a few regular files (a Dockerfile's build context made in the page).
const enc = new TextEncoder()

function field(h: Uint8Array, off: number, len: number, s: string): void {
  h.set(enc.encode(s).subarray(0, len), off)
}

function octal(n: number, len: number): string {
  return n.toString(8).padStart(len - 1, "0") + "\0"
}

export function tar(files: { name: string; data: Uint8Array; mode?: number }[]): Uint8Array {
  const parts: Uint8Array[] = []
  const now = Math.floor(Date.now() / 1000)
  for (const f of files) {
    if (!/^[A-Za-z0-9._-][A-Za-z0-9._/-]{0,98}$/.test(f.name) || f.name.split("/").includes("..")) {
      throw new Error(`bad file name in the build context: ${f.name}`)
    }
    const h = new Uint8Array(512)
    field(h, 0, 100, f.name)
    field(h, 100, 8, octal(f.mode ?? 0o644, 8))
    field(h, 108, 8, octal(0, 8))
    field(h, 116, 8, octal(0, 8))
    field(h, 124, 12, octal(f.data.length, 12))
    field(h, 136, 12, octal(now, 12))
    field(h, 148, 8, "        ")
    field(h, 156, 1, "0")
    field(h, 257, 6, "ustar\0")
    field(h, 263, 2, "00")
    let sum = 0
    for (const b of h) sum += b
    field(h, 148, 8, sum.toString(8).padStart(6, "0") + "\0 ")
    parts.push(h, f.data, new Uint8Array((512 - (f.data.length % 512)) % 512))
  }
  parts.push(new Uint8Array(1024))
  const n = parts.reduce((a, p) => a + p.length, 0)
  const out = new Uint8Array(n)
  let o = 0
  for (const p of parts) { out.set(p, o); o += p.length }
  return out
}
