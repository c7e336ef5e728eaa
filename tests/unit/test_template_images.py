"""Template snapshots (lifecycle.template_images.TemplateImages) as a collaborator of their
own: given a backend and the Manager's boot, quiesce, teardown and lock as recorders, a
template's image is made once for any number of creates asking at once (booted with the
template boot's mark, quiesced, checkpointed, its agent's key beside it, the sandbox torn
down), named by build, agent and machine kind; ``made`` lists it; ``forget`` deletes the
template's images of every build; a backend that cannot checkpoint makes none. (The warm
pool: tests/unit/test_pool.py; real images: tests/e2e/test_snapshots.py.)"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from cpuosd.config import Config
from cpuosd.lifecycle.common import Live
from cpuosd.lifecycle.template_images import TemplateImages
from cpuosd.store import SandboxRow
from support.fakes import FakeBackend


class Checkpointing(FakeBackend):
    async def checkpoint(self, sandbox_id: str, image_dir: Path) -> None:
        await super().checkpoint(sandbox_id, image_dir)
        image_dir.mkdir(parents=True)
        (image_dir / "checkpoint.img").write_bytes(b"image")


def test_an_image_is_made_once_listed_and_forgotten(tmp_path: Path) -> None:
    tdir = tmp_path / "templates"
    (tdir / "rootfs").mkdir(parents=True)
    info = {"name": "python", "digest": "1" * 16, "rootfs": str(tdir / "rootfs")}
    (tdir / "python.json").write_text(json.dumps(info))
    cfg = Config(home=tmp_path / "home", templates_path=tdir)
    agent_dir = cfg.home / "agent" / "0123456789abcdef"
    calls: list[str] = []
    locks: dict[str, asyncio.Lock] = {}

    async def boot(row: SandboxRow, image: Path | None, *, template_boot: bool = False,
                   resume: bool = False) -> Live:
        assert image is None and template_boot and row.spec.network == {
            "mode": "off", "allow": []}
        calls.append("boot")
        await asyncio.sleep(0)  # (the other create asks meanwhile)
        row.spec = replace(row.spec, agent_key="k" * 64)
        return Live(row, cast(Any, None), cast(Any, SimpleNamespace()))

    async def quiesce(lv: Live) -> None:
        calls.append("quiesce")

    async def teardown(sid: str) -> None:
        assert sid.startswith("tpl-")
        calls.append("teardown")

    def save_agent_key(lv: Live, image_dir: Path) -> None:
        (image_dir / "agent.key").write_text(str(lv.row.spec.agent_key))

    def images(backend: FakeBackend) -> TemplateImages:
        return TemplateImages(cfg, backend, agent_dir,
                              lock=lambda k: locks.setdefault(k, asyncio.Lock()), boot=boot,
                              teardown=teardown, quiesce=quiesce,
                              save_agent_key=save_agent_key)

    async def main() -> None:
        backend = Checkpointing()
        ti = images(backend)
        name = ti.name("python", "1" * 16)
        assert name == f"python-{'1' * 16}-0123456789abcdef-fake-p" \
            f"{cfg.sandbox.default_pids}-d{cfg.sandbox.default_disk_mib}"
        assert ti.made() == []
        a, b = await asyncio.gather(ti.ensure("python", info), ti.ensure("python", info))
        d = cfg.snapshots_dir / "templates" / name
        assert a == b == d and (d / "checkpoint.img").exists()
        assert (d / "agent.key").read_text() == "k" * 64
        assert calls == ["boot", "quiesce", "teardown"] and backend.calls == ["checkpoint"]
        assert ti.made() == ["python"]
        older = cfg.snapshots_dir / "templates" / f"python-{'2' * 16}-older-agent"
        older.mkdir()
        other = cfg.snapshots_dir / "templates" / f"pythonx-{'1' * 16}-other-template"
        other.mkdir()
        assert await ti.forget("python") == 2
        assert not d.exists() and not older.exists() and other.is_dir()
        assert ti.made() == []

        calls.clear()
        assert await images(FakeBackend(checkpoint=False)).ensure("python", info) is None
        assert calls == []

    asyncio.run(main())
