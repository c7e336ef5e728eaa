import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_sync_sdk_is_generated_from_async() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_sync.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_sync_and_async_expose_the_same_api() -> None:
    from cpuos import AsyncFiles, AsyncSandbox, Files, Sandbox

    def public(cls: type) -> set[str]:
        return {n for n in vars(cls) if not n.startswith("_")}

    assert public(Sandbox) == public(AsyncSandbox)
    assert public(Files) == public(AsyncFiles)
