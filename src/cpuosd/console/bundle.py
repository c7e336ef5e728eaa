"""The console's built bundle (``static/``, made by ``npm run build`` in ``console/``) and the
hash of the sources it was built from, so a stale bundle is found (tests/unit/
test_console_bundle.py; ``console/scripts/stamp.mjs`` computes the same hash in the build).

The hash: SHA-256 over the sorted relative paths of the source files (``SOURCES`` under
``console/``), each as ``<path>\\0<sha256 of its bytes>\\n``.

    python3 src/cpuosd/console/bundle.py [--check]   # prints the sources' hash
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

STATIC = Path(__file__).resolve().parent / "static"
STAMP = "build.json"  # in STATIC: {"sources": <hash>, ...}
SOURCES = ("index.html", "package.json", "package-lock.json", "tsconfig.json",
           "vite.config.ts", "scripts", "src", "public")


def repo_console_dir() -> Path:
    """``console/`` of the source tree this module sits in (src/cpuosd/console/...)."""
    return Path(__file__).resolve().parents[3] / "console"


def source_files(root: Path) -> list[str]:
    out: list[str] = []
    for name in SOURCES:
        p = root / name
        if p.is_file():
            out.append(name)
        elif p.is_dir():
            out += [f.relative_to(root).as_posix() for f in p.rglob("*") if f.is_file()]
    return sorted(out)


def sources_hash(root: Path) -> str:
    h = hashlib.sha256()
    for rel in source_files(root):
        h.update(f"{rel}\0{hashlib.sha256((root / rel).read_bytes()).hexdigest()}\n".encode())
    return h.hexdigest()


def built_hash(static: Path = STATIC) -> str | None:
    """The sources' hash the bundle in ``static`` was built from (None: no bundle)."""
    try:
        stamp = json.loads((static / STAMP).read_text())
    except (OSError, ValueError):
        return None
    v = stamp.get("sources") if isinstance(stamp, dict) else None
    return v if isinstance(v, str) else None


if __name__ == "__main__":
    root = repo_console_dir()
    want = sources_hash(root)
    if "--check" in sys.argv[1:]:
        got = built_hash()
        if got != want:
            print(f"console bundle is {'missing' if got is None else 'stale'}: run "
                  "`npm ci && npm run build` in console/", file=sys.stderr)
            sys.exit(1)
    print(want)
