"""Benchmark 20: the web console (/ui) in a real browser (Debian's chromium, headless, through
Playwright) with N sandboxes alive (full 100, quick 30, smoke 3; ``--sandboxes N``):

- first paint of the sandboxes page: from the navigation's start (an open session, a fresh
  page each time) to the frame after all N rows are in the page, beside the floor: the two
  API calls the page waits for (``GET /ui/session``, ``GET /sandboxes``) fetched in sequence
  from an already loaded page of the same origin (target: at most 1 s);
- event-to-screen latency of a state change: a sandbox is paused and resumed through the
  API; for each transition (pausing, paused, resuming, running) the time its row shows the
  new state minus the daemon's time of the event, beside the floor: the same events' delay
  to a plain client of ``GET /events`` (target: at most 500 ms).

Both clocks are this host's (the daemon's ``time.time()`` and the page's ``Date.now()``).

    .venv/bin/python bench/cases/console.py [--quick | --smoke] [--sandboxes N]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # for `support`
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `cases`

from cases._common import (FROM_SNAPSHOT, Context, Row, case_main, console, median, ms, pct,
                           target_row, timing_table)

from support.browser import chromium_unavailable, launch
from support.daemon import Daemon

SECTION = KEY = "console"
TITLE = "20. console: first paint with N sandboxes, event-to-screen latency"
DAEMON = FROM_SNAPSHOT
STATES = ("pausing", "paused", "resuming", "running")

# in every page before its scripts: when all N rows are there, the time (ms since the
# navigation's start) of the frame that shows them; and when a row's state changes, the
# wall-clock time it changed at
WATCH = """(() => {
  const want = %d
  window.__paint = null
  window.__seen = []
  new MutationObserver((muts) => {
    for (const m of muts) {
      if (m.type === "attributes" && m.attributeName === "data-state" && m.target.dataset.sid)
        window.__seen.push([m.target.dataset.sid, m.target.dataset.state, Date.now() / 1000])
    }
    if (window.__paint === null && document.querySelectorAll("tr[data-sid]").length >= want) {
      window.__paint = -1
      requestAnimationFrame(() => setTimeout(() => { window.__paint = performance.now() }, 0))
    }
  }).observe(document, { subtree: true, childList: true, attributes: true,
                         attributeFilter: ["data-state"] })
})()"""
FLOOR = """async () => {
  const t0 = performance.now()
  await (await fetch("/ui/session", { cache: "no-store" })).json()
  await (await fetch("/sandboxes", { cache: "no-store" })).json()
  return performance.now() - t0
}"""


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--sandboxes", type=int, metavar="N",
                    help="sandboxes alive during the measurement (default: full 100, quick "
                         "30, smoke 3)")


def make_sandboxes(d: Daemon, n: int) -> list[str]:
    """n sandboxes (4 creates at a time); stops early where the host is full (429)."""
    made: list[str] = []
    full: list[str] = []

    def one(_: int) -> None:
        if full:
            return
        with d.client() as c:
            r = c.post("/sandboxes", json={"template": "python", "timeout": "60m",
                                           "idle_timeout": 0}, timeout=300)
        if r.status_code == 429:
            full.append(r.json()["error"]["message"])
            return
        r.raise_for_status()
        made.append(r.json()["id"])

    with ThreadPoolExecutor(4) as ex:
        list(ex.map(one, range(n)))
    if full:
        console.print(f"  [yellow]the host took {len(made)} of {n} sandboxes: {full[0]}[/]")
    return made


class Events(threading.Thread):
    """A plain client of GET /events: when each (sandbox, state) event reached it."""

    def __init__(self, d: Daemon) -> None:
        super().__init__(daemon=True)
        self.d = d
        self.got: list[tuple[str, str, float, float]] = []  # sid, kind, event time, received
        self.ready = threading.Event()
        self.stop = False

    def run(self) -> None:
        with self.d.client() as c, c.stream("GET", "/events", timeout=None) as r:
            kind = None
            for line in r.iter_lines():
                if self.stop:
                    return
                if line.startswith("event: "):
                    kind = line[7:]
                    if kind == "hello":
                        self.ready.set()
                elif line.startswith("data: ") and kind in STATES:
                    ev = json.loads(line[6:])
                    self.got.append((ev["sandbox"], ev["kind"], ev["time"], time.time()))


def watch_trouble(page: Any) -> list[str]:
    """What went wrong on the page as it loads (failed requests, answers >= 400, console
    errors), kept to say why a first paint never came."""
    out: list[str] = []

    def answered(r: Any) -> None:
        if r.status >= 400:
            out.append(f"answer {r.status}: {r.request.method} {r.url}")

    def logged(m: Any) -> None:
        if m.type in ("error", "warning"):
            out.append(f"console {m.type}: {m.text[:300]}")

    page.on("requestfailed", lambda r: out.append(f"request failed: {r.method} {r.url}: "
                                                   f"{r.failure}"))
    page.on("response", answered)
    page.on("console", logged)
    page.on("pageerror", lambda e: out.append(f"page error: {str(e)[:300]}"))
    return out


def wait_paint(page: Any, trouble: list[str], timeout_s: float = 120) -> None:
    """Until the sandboxes page has painted its rows (WATCH); if it never does, an error
    that says what the page showed and what went wrong on it."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function("() => window.__paint > 0", timeout=timeout_s * 1000)
    except PlaywrightTimeout:
        seen = page.evaluate("""() => ({paint: window.__paint,
            rows: document.querySelectorAll("tr[data-sid]").length,
            url: location.href, text: document.body.innerText.slice(0, 600)})""")
        raise RuntimeError(f"no first paint in {timeout_s:g} s: {seen}; on the page: "
                           f"{trouble[-20:] or 'nothing failed'}") from None


def measure(ctx: Context) -> dict[str, Any]:
    why = chromium_unavailable()
    if why:
        raise RuntimeError(f"the console benchmark needs a browser: {why}")
    from playwright.sync_api import sync_playwright

    d = ctx.daemon(DAEMON)
    want = getattr(ctx.args, "sandboxes", None) or ctx.pick(100, 30, 3)
    paints, cycles = ctx.pick(10, 5, 2), ctx.pick(10, 4, 1)
    out: dict[str, Any] = {"n_asked": want, "runs": paints, "cycles": cycles}
    t0 = time.monotonic()
    ids = make_sandboxes(d, want)
    out["sandboxes"] = len(ids)
    out["create_all_s"] = time.monotonic() - t0
    console.print(f"  {len(ids)} sandboxes alive ({out['create_all_s']:.0f} s to make)")
    if not ids:
        raise RuntimeError("no sandbox could be made")
    ev = Events(d)
    ev.start()
    if not ev.ready.wait(30):
        raise RuntimeError("GET /events did not answer")
    try:
        with sync_playwright() as pw:
            browser = launch(pw)
            try:
                paint_s, floor_s = [], []
                for _ in range(paints):
                    bctx = browser.new_context(viewport={"width": 1280, "height": 800})
                    r = bctx.request.post(d.url + "/ui/session", data={"key": d.key},
                                          headers={"Origin": d.url})
                    if not r.ok:
                        raise RuntimeError(f"sign-in failed: {r.status} {r.text()}")
                    page = bctx.new_page()
                    page.add_init_script(WATCH % len(ids))
                    trouble = watch_trouble(page)
                    page.goto(d.url + "/ui/#/sandboxes")
                    wait_paint(page, trouble)
                    paint_s.append(page.evaluate("() => window.__paint") / 1000)
                    floor_s.append(page.evaluate(FLOOR) / 1000)
                    bctx.close()
                out["ours_paint_s"], out["floor_api_s"] = paint_s, floor_s
                console.print(f"  first paint of {len(ids)} rows: p50 {ms(median(paint_s))}; "
                              f"its API calls alone: p50 {ms(median(floor_s))}")
                # the list page stays open while one sandbox is paused and resumed
                bctx = browser.new_context(viewport={"width": 1280, "height": 800})
                bctx.request.post(d.url + "/ui/session", data={"key": d.key},
                                  headers={"Origin": d.url})
                page = bctx.new_page()
                page.add_init_script(WATCH % len(ids))
                trouble = watch_trouble(page)
                page.goto(d.url + "/ui/#/sandboxes")
                wait_paint(page, trouble)
                page.wait_for_selector(".live.on", timeout=60_000)
                target = ids[-1]
                t_first = time.time()
                with d.client() as c:
                    for _ in range(cycles):
                        for op in ("pause", "resume"):
                            c.post(f"/sandboxes/{target}/{op}", timeout=300).raise_for_status()
                            page.wait_for_function(
                                f"() => window.__seen.some(([s, st]) => s === '{target}' && "
                                f"st === '{'paused' if op == 'pause' else 'running'}')",
                                timeout=60_000)
                            page.evaluate("() => { window.__seenDone = (window.__seenDone "
                                          "|| []).concat(window.__seen); window.__seen = [] }")
                seen = page.evaluate("() => window.__seenDone")
                bctx.close()
            finally:
                browser.close()
    finally:
        ev.stop = True
    # pair each event with the first time the screen (or the plain client) showed it after it
    ours, floor = [], []
    events = [(s, k, t, rcv) for s, k, t, rcv in ev.got if s == target and t >= t_first - 1]
    used: set[int] = set()
    for s, k, t, rcv in events:
        floor.append(rcv - t)
        for i, (ss, st, at) in enumerate(seen):
            if i not in used and ss == s and st == k and at >= t - 0.05:
                used.add(i)
                ours.append(max(0.0, at - t))
                break
    out["events"] = len(events)
    out["ours_event_s"], out["floor_event_s"] = ours, floor
    if not ours:
        raise RuntimeError(f"no state change reached the screen: events {events}, seen {seen}")
    console.print(f"  event → screen: p50 {ms(median(ours))} over {len(ours)} transitions "
                  f"(of {len(events)} events); → a plain /events client: p50 "
                  f"{ms(median(floor))}")
    return out


def report(r: dict[str, Any]) -> list[Row]:
    timing_table(
        f"20. console: first paint with N sandboxes, event-to-screen latency "
        f"(N={r['sandboxes']} sandboxes, {r['runs']} page loads, {r['cycles']} pause/resume "
        "cycles)",
        [("ours: first paint of the sandboxes page", r["ours_paint_s"]),
         ("floor: GET /ui/session + GET /sandboxes from the page", r["floor_api_s"]),
         ("ours: event → row shows the state", r["ours_event_s"]),
         ("floor: event → a plain GET /events client", r["floor_event_s"])])
    return [{**target_row("console first paint of the sandboxes page, p50",
                          median(r["ours_paint_s"]), median(r["floor_api_s"]), 1.0, "≤ 1 s"),
             "note": f"{r['sandboxes']} sandboxes alive (asked {r['n_asked']})"},
            {**target_row("console event → screen, p50", median(r["ours_event_s"]),
                          median(r["floor_event_s"]), 0.5, "≤ 500 ms"),
             "note": f"p95 {ms(pct(r['ours_event_s'], 95))} over {len(r['ours_event_s'])} "
                     "state changes"}]


if __name__ == "__main__":
    sys.exit(case_main(__name__))
