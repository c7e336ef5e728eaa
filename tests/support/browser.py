"""Driving the console in a real browser, for its tests and its benchmark: Debian's chromium
(``apt-get install chromium``: ``scripts/setup.sh --dev``) headless through Playwright's
Python client (Playwright's own browser download is not used). Playwright gives every
launch a fresh profile (a temporary ``--user-data-dir``, removed at close)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page, Playwright

CHROMIUM = os.environ.get("CPUOS_TEST_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run",
        "--disable-dev-shm-usage"]
SCREENSHOTS = Path.cwd() / ".cache" / "console"


def chromium_unavailable() -> str | None:
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)) \
            and shutil.which(CHROMIUM) is None:
        return (f"no chromium at {CHROMIUM} (apt-get install chromium; scripts/setup.sh "
                "--dev does)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (pip install -e '.[dev]')"
    return None


def launch(pw: Playwright) -> Browser:
    return pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)


def sign_in(page: Page, base_url: str, key: str) -> None:
    """Open the console and sign in with ``key``; returns once the app's header shows."""
    page.goto(base_url + "/ui/")
    page.fill("#key", key)
    page.click("button[type=submit]")
    page.wait_for_selector("header.top", timeout=60_000)


def shot(page: Page, name: str, **kw: Any) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), **kw)
    return path


# pixels of the colour ``rgb`` (within ``tol`` per channel) on each canvas matching ``sel``
COUNT_PIXELS = """([sel, rgb, tol]) => [...document.querySelectorAll(sel)].map((c) => {
  const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data
  let n = 0
  for (let i = 0; i < d.length; i += 4) {
    if (d[i + 3] > 0 && (rgb === null || (Math.abs(d[i] - rgb[0]) <= tol
        && Math.abs(d[i + 1] - rgb[1]) <= tol && Math.abs(d[i + 2] - rgb[2]) <= tol))) n++
  }
  return n
})"""
