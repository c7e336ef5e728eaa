"""Directories as tar streams: a 500-file tree round-trips byte-exact with its modes;
archives with '..', absolute paths or symlinks pointing out are refused with a clear error
and write nothing."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from cpuos import Sandbox
from support.daemon import Daemon

pytestmark = pytest.mark.e2e


def _tree(root: Path) -> dict[str, tuple[str, int, bytes]]:
    out: dict[str, tuple[str, int, bytes]] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        st = p.lstat()
        if stat.S_ISLNK(st.st_mode):
            out[rel] = ("link", 0, os.readlink(p).encode())
        elif stat.S_ISDIR(st.st_mode):
            out[rel] = ("dir", stat.S_IMODE(st.st_mode), b"")
        else:
            out[rel] = ("file", stat.S_IMODE(st.st_mode), p.read_bytes())
    return out


def test_tree_round_trips(sbx: Sandbox, tmp_path: Path) -> None:
    src = tmp_path / "src"
    modes = (0o644, 0o755, 0o600, 0o700)
    for i in range(500):
        d = src / f"d{i % 7}" / f"sub{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        f = d / f"f{i}.bin"
        f.write_bytes(os.urandom(i * 37 % 5000))
        f.chmod(modes[i % 4])
    (src / "empty").mkdir()
    (src / "d0" / "link").symlink_to("sub0/f0.bin")
    (src / "d1").chmod(0o750)
    n = sbx.files.upload_dir(src, "/work/tree")
    assert (n["files"], n["links"]) == (500, 1), n
    r = sbx.exec("find /work/tree -type f | wc -l; stat -c %a /work/tree/d1 "
                 "/work/tree/d0/sub0/f0.bin; readlink /work/tree/d0/link")
    assert r.stdout.split() == ["500", "750", "644", "sub0/f0.bin"], r
    back = tmp_path / "back"
    assert sbx.files.download_dir("/work/tree", back) > 0
    assert _tree(back) == _tree(src)


def _archive(*entries: tuple[str, str, str | bytes]) -> bytes:
    """(name, kind, data or link target) -> a tar."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, kind, data in entries:
            info = tarfile.TarInfo(name)
            if kind == "sym":
                info.type, info.linkname = tarfile.SYMTYPE, str(data)
                tf.addfile(info)
            elif kind == "fifo":
                info.type = tarfile.FIFOTYPE
                tf.addfile(info)
            else:
                b = data if isinstance(data, bytes) else data.encode()
                info.size = len(b)
                tf.addfile(info, io.BytesIO(b))
    return buf.getvalue()


@pytest.mark.parametrize("bad, why", [
    ((("ok.txt", "file", "x"), ("../escape.txt", "file", "x")), "'..'"),
    ((("ok.txt", "file", "x"), ("/tmp/abs.txt", "file", "x")), "absolute"),
    ((("ok.txt", "file", "x"), ("out", "sym", "/etc")), "points outside"),
    ((("ok.txt", "file", "x"), ("up", "sym", "../../etc/passwd")), "points outside"),
    ((("in", "sym", "."), ("in/x.txt", "file", "x")), "through a link"),
    ((("ok.txt", "file", "x"), ("pipe", "fifo", "")), "not a file"),
])
def test_bad_archives_write_nothing(daemon: Daemon, sbx: Sandbox,
                                    bad: tuple[tuple[str, str, str], ...], why: str) -> None:
    with daemon.client() as c:
        r = c.put(f"/sandboxes/{sbx.id}/files/tar", params={"path": "/work/target"},
                  content=_archive(*bad))
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_argument" and why in err["message"], err
    # nothing written: not the good entry, not the archive, not outside
    r2 = sbx.exec("ls -A /work/target 2>/dev/null; ls /work/escape.txt /tmp/abs.txt 2>&1")
    assert "ok.txt" not in r2.stdout and ".cpuos-upload" not in r2.stdout, r2.stdout
    assert "No such file" in r2.stdout


def test_cli_put_get_recursive(daemon: Daemon, sbx: Sandbox, tmp_path: Path) -> None:
    import subprocess
    import sys

    src = tmp_path / "src"
    (src / "a" / "b").mkdir(parents=True)
    (src / "a" / "b" / "x.sh").write_text("echo hi\n")
    (src / "a" / "b" / "x.sh").chmod(0o755)
    (src / "top.txt").write_text("top\n")
    cli = [str(Path(sys.executable).parent / "cpuos")]
    env = {**os.environ, "CPUOS_API_URL": daemon.url, "CPUOS_API_KEY": daemon.key}
    r = subprocess.run([*cli, "files", "put", "-r", sbx.id, str(src), "/work/cli"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "2 files" in r.stdout, r
    assert sbx.exec("/work/cli/a/b/x.sh").stdout == "hi\n"
    r = subprocess.run([*cli, "files", "get", "-r", sbx.id, "/work/cli", str(tmp_path / "back")],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r
    assert _tree(tmp_path / "back") == _tree(src)
    r = subprocess.run([*cli, "files", "get", "-r", sbx.id, "/work/nonexistent",
                        str(tmp_path / "none")], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r
