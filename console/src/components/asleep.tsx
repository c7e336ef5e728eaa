import { useState } from "preact/hooks"
import { post } from "../api"
import { idlePaused } from "../util"
import { toastError } from "./ui"

/** What a tab that needs the machine shows while the sandbox is not running. Paused for
 * idleness: a button that wakes it (a tab opened only to look does not wake it by itself);
 * paused on request: it must be resumed (its calls are refused until then). */
export function NotRunning({ s, ws, what }: {
  s: { id: string; state: string; reason: string | null }; ws: string | null; what: string
}) {
  const [busy, setBusy] = useState(false)
  if (idlePaused(s)) {
    const wake = async () => {
      setBusy(true)
      try { await post(`/sandboxes/${s.id}/resume`, {}, { ws }) } catch (x) { toastError(x, "wake") } finally { setBusy(false) }
    }
    return (
      <div class="note asleep" data-asleep="idle">
        <p>Paused while idle: nothing ran for its idle timeout, so it sleeps and costs only its
          snapshot. Anything that needs the machine (a command, a terminal, files) wakes it.</p>
        <button type="button" class="primary" onClick={wake} disabled={busy}>{busy ? "Waking…" : `Wake it to ${what}`}</button>
      </div>
    )
  }
  if (s.state === "paused") {
    return <p class="note" data-asleep="paused">Paused{s.reason ? ` (${s.reason})` : ""}: calls to it are refused until it is resumed. Resume it to {what}.</p>
  }
  return <p class="note">The sandbox is {s.state}: it must be running to {what}.</p>
}
