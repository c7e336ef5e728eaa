// Writes (or with --check, compares) the hash of the console's sources into the built
// bundle's build.json. The same hash as cpuosd/console/bundle.py computes (a test compares
// them, so a bundle built from other sources fails the tests): SHA-256 over the sorted
// relative paths of SOURCES, each as "<path>\0<sha256 of its bytes>\n".
import { createHash } from "node:crypto"
import { existsSync, readFileSync, readdirSync, statSync, writeFileSync } from "node:fs"
import { dirname, join, relative } from "node:path"
import { fileURLToPath } from "node:url"

const root = join(dirname(fileURLToPath(import.meta.url)), "..")
const SOURCES = ["index.html", "package.json", "package-lock.json", "tsconfig.json",
  "vite.config.ts", "scripts", "src", "public"]
const OUT = join(root, "..", "src", "cpuosd", "console", "static", "build.json")

function walk(p, out) {
  for (const name of readdirSync(p)) {
    const q = join(p, name)
    if (statSync(q).isDirectory()) walk(q, out)
    else out.push(relative(root, q).split("\\").join("/"))
  }
}

export function sourcesHash() {
  const files = []
  for (const name of SOURCES) {
    const p = join(root, name)
    if (!existsSync(p)) continue
    if (statSync(p).isDirectory()) walk(p, files)
    else files.push(name)
  }
  // sorted as Python sorts str: by code point
  files.sort((a, b) => (a < b ? -1 : a > b ? 1 : 0))
  const h = createHash("sha256")
  for (const rel of files) {
    const d = createHash("sha256").update(readFileSync(join(root, rel))).digest("hex")
    h.update(`${rel}\0${d}\n`)
  }
  return h.digest("hex")
}

const want = sourcesHash()
if (process.argv.includes("--check")) {
  let got = null
  try { got = JSON.parse(readFileSync(OUT, "utf8")).sources } catch { /* no bundle */ }
  if (got !== want) {
    console.error(`console bundle is ${got ? "stale" : "missing"}: npm ci && npm run build`)
    process.exit(1)
  }
  console.log(`console bundle is up to date (${want.slice(0, 12)})`)
} else {
  writeFileSync(OUT, JSON.stringify({ sources: want, built_at: new Date().toISOString() }) + "\n")
  console.log(`console bundle stamped ${want.slice(0, 12)}`)
}
