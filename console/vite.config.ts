// The console's build: Preact (JSX through Vite's own transform), uPlot, @xterm/xterm; the
// bundle goes into the Python package, which serves it at /ui (cpuosd.console).
import { defineConfig } from "vite"

export default defineConfig({
  base: "/ui/",
  publicDir: "public",
  build: {
    outDir: "../src/cpuosd/console/static",
    emptyOutDir: true,
    assetsDir: "assets",
    sourcemap: false,
    target: "es2022",
    // no inline module-preload helper: nothing for the Content-Security-Policy to allow
    // beyond 'self'. Chunks: the first page (sign-in, the sandbox list); the other pages with
    // uPlot (pages/lazy.ts); the terminal with xterm.js
    modulePreload: { polyfill: false },
    chunkSizeWarningLimit: 1024,
  },
  server: {
    // `npm run dev`: the API of a local daemon behind Vite's dev server
    proxy: Object.fromEntries(
      ["/sandboxes", "/templates", "/usage", "/metrics", "/events", "/workspace", "/workspaces",
       "/audit", "/health", "/ui/session"].map((p) => [p, { target: "http://127.0.0.1:7770", ws: true }]),
    ),
  },
})
