"""Template images shared by the daemons of one host (CPUOS_TEMPLATE_IMAGES_DIR): a daemon
with another $CPUOS_HOME (so its sandboxes mount another agent copy, other socket dirs)
restores the image a first daemon made, and its sandbox runs, writes, pauses and resumes."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from cpuos import Sandbox
from support.daemon import Daemon, e2e_unavailable, new_daemon

pytestmark = pytest.mark.e2e


@pytest.fixture
def images() -> Iterator[Path]:
    why = e2e_unavailable()
    if why:
        pytest.skip(why)
    d = Path(tempfile.mkdtemp(prefix="cpuos-timages-t-", dir="/tmp"))  # (not the session's)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _daemon(images: Path, made: list[Daemon]) -> Daemon:
    d = new_daemon(CPUOS_TEMPLATE_IMAGES_DIR=str(images), CPUOS_POOL_SIZE="0")
    made.append(d)
    d.start()
    return d


def _python_images(images: Path) -> list[Path]:
    return sorted(p for p in images.glob("python-*") if (p / "checkpoint.img").exists())


def test_a_second_daemon_restores_the_first_daemons_image(
        images: Path, request: pytest.FixtureRequest) -> None:
    made: list[Daemon] = []
    try:
        a = _daemon(images, made)
        sa = Sandbox.create(template="python", timeout="5m", **a.sdk_kwargs())
        assert sa.exec("echo a").stdout == "a\n"
        [image] = _python_images(images)
        assert a.template_image("python")[0] == image
        ino = (image / "checkpoint.img").stat().st_ino

        b = _daemon(images, made)
        assert b.home != a.home
        sb = Sandbox.create(template="python", timeout="5m", **b.sdk_kwargs())
        # b restored a's image (made none of its own: one image, the same file)
        assert _python_images(images) == [image]
        assert (image / "checkpoint.img").stat().st_ino == ino
        assert "snapshotted in" not in b.log.read_text()
        assert f"restore of {sb.id}" in b.log.read_text()
        assert b.template_image("python")[0] == image
        # its agent is b's copy (mounted from b's home), and the sandbox works
        assert sb.exec("echo b; python3 -c 'print(6*7)'").stdout == "b\n42\n"
        sb.files.write("/home/user/note.txt", "from b")
        assert sb.exec("cat /home/user/note.txt").stdout == "from b"
        sid = sb.pause()
        sb = Sandbox.resume(sid, **b.sdk_kwargs())
        assert sb.exec("cat /home/user/note.txt; echo; hostname").stdout == f"from b\n{sid}\n"
        assert sa.exec("echo still").stdout == "still\n"
        # (a template's removal leaving an image another daemon uses:
        # tests/unit/test_template_images.py; here the templates are the session's)
        sa.kill()
        sb.kill()
    finally:
        failed = getattr(request.config, "_cpuos_failed", False)
        for d in made:
            assert not d.teardown(failed)
