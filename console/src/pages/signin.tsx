import { useState } from "preact/hooks"
import { ApiError, signIn, type Who } from "../api"

export function SignIn({ onSignedIn, why }: { onSignedIn: (w: Who) => void; why: string | null }) {
  const [key, setKey] = useState("")
  const [busy, setBusy] = useState(false)
  const [err, setErr] = useState<string | null>(null)
  const submit = async (e: Event) => {
    e.preventDefault()
    setBusy(true)
    setErr(null)
    try {
      const w = await signIn(key.trim())
      setKey("")
      onSignedIn(w)
    } catch (x) {
      setErr((x as ApiError).message ?? String(x))
    } finally {
      setBusy(false)
    }
  }
  return (
    <main class="signin" id="main">
      <form onSubmit={submit} aria-describedby="signin-help">
        <h1>cpuos console</h1>
        {why && !err && <p class="note" role="status">{why}</p>}
        <label for="key">API key</label>
        <input id="key" name="key" type="password" autocomplete="off" spellcheck={false} required autofocus
          placeholder="cpk_…" value={key} onInput={(e) => setKey((e.target as HTMLInputElement).value)}
          aria-invalid={err ? "true" : undefined} aria-describedby={err ? "signin-error" : undefined} />
        {err && <p id="signin-error" class="error-text" role="alert">{err}</p>}
        <button type="submit" class="primary" disabled={busy || !key.trim()}>{busy ? "Signing in…" : "Sign in"}</button>
        <p id="signin-help" class="help">
          Paste a key of your workspace (<code>cpuos key create</code>) or the admin key
          (<code>$CPUOS_HOME/admin.key</code>). It is exchanged for a session cookie and is not kept by this page.
        </p>
      </form>
    </main>
  )
}
