"""Archives and big files from hostile sandboxes (issue 25, findings 3, 8 and 11), each run
as the attack itself against a real daemon and real sandboxes:

3. a chain of links that looks inside as text (``a -> .``, ``x1 -> a/..``, ``x2 -> x1/..``)
   climbs a level per link: ``download_dir`` into a host folder refuses it, and a second
   download into a folder holding such a chain (as an older SDK left it) writes nothing
   outside, chowns nothing; ``upload_dir`` into a sandbox directory where code inside
   planted the chain writes nothing outside the destination;
8. a build context crafted for CVE-2025-4517 (links whose resolved path passes PATH_MAX,
   which tarfile's ``data`` filter on the set-up's Python 3.11.7 lets through) is refused
   through ``POST /templates/build`` with a 422 naming the entry; nothing is written
   outside the upload folder;
11. a 1 TiB sparse file inside: reads, downloads and ``download_dir`` end with a typed
   ``too_large`` at once, with nothing huge received, spooled or written on the host.
"""

from __future__ import annotations

import io
import os
import resource
import secrets
import stat
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from cpuos import InvalidArgument, Sandbox, ServerError
from cpuos_agent import protocol as P
from support.daemon import Daemon

pytestmark = pytest.mark.e2e

CHAIN = "ln -s . a && ln -s a/.. x1 && ln -s x1/.. x2 && ln -s x2/.. x3"


def _snapshot(root: Path, skip: Path) -> dict[str, tuple[int, int, int, int]]:
    """Every path under root outside skip: (mode, uid, gid, size)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath, n)
            if p == skip or skip in p.parents:
                continue
            st = p.lstat()
            size = 0 if stat.S_ISDIR(st.st_mode) else st.st_size
            out[str(p)] = (st.st_mode, st.st_uid, st.st_gid, size)
    st = root.lstat()
    out[str(root)] = (st.st_mode, st.st_uid, st.st_gid, 0)
    return out


# ---- 3: download_dir and upload_dir ----------------------------------------------------------
def test_download_dir_link_chain_writes_nothing_outside(sbx: Sandbox, tmp_path: Path) -> None:
    host = tmp_path / "l1" / "l2" / "l3"
    dest = host / "dl"
    host.mkdir(parents=True)
    (tmp_path / "l1" / "keep.txt").write_text("mine")
    before = _snapshot(tmp_path, dest)
    # download 1: the sandbox's directory holds the chain and files "through" it
    r = sbx.exec(f"mkdir -p /work/evil && cd /work/evil && {CHAIN} && echo x > plain.txt")
    assert r.exit_code == 0, r.stderr
    with pytest.raises(ServerError, match=r"has '\.\.'"):
        sbx.files.download_dir("/work/evil", dest)
    assert not dest.exists() or not any(dest.iterdir())
    # download 2 into a folder where the chain is already on disk (what the SDK before
    # this fix wrote), from a directory whose entries are named through the links
    dest.mkdir(exist_ok=True)
    for name, target in (("a", "."), ("x1", "a/.."), ("x2", "x1/.."), ("x3", "x2/..")):
        os.symlink(target, dest / name)
    r = sbx.exec("rm -rf /work/evil && mkdir -p /work/evil/x3/sub /work/evil/x2 && cd "
                 "/work/evil && echo pwned > x3/pwned && echo pwned > x3/sub/pwned && "
                 "echo pwned > x2/pwned && chmod 777 x3 x2 && ls -R")
    assert r.exit_code == 0, r.stderr
    assert sbx.files.download_dir("/work/evil", dest) > 0
    # the archive's directories replaced the links (never followed): all of it is inside
    assert (dest / "x3").is_dir() and not (dest / "x3").is_symlink()
    assert (dest / "x3" / "sub" / "pwned").read_text() == "pwned\n"
    assert _snapshot(tmp_path, dest) == before  # nothing outside written, chmod-ed, chowned
    for p in dest.rglob("*"):
        assert p.lstat().st_uid == os.getuid(), p  # nothing chowned to the sandbox's uid
    # a link on disk whose name the archive does not redefine is never written through
    os.symlink(str(tmp_path / "l1"), dest / "x3" / "sub2")
    sbx.exec("mkdir -p /work/evil2/x3/sub2 && echo pwned > /work/evil2/x3/sub2/pwned")
    assert sbx.files.download_dir("/work/evil2", dest) > 0
    assert not (tmp_path / "l1" / "pwned").exists()
    assert _snapshot(tmp_path, dest) == before


def test_upload_dir_never_writes_outside_its_destination(daemon: Daemon, sbx: Sandbox,
                                                         tmp_path: Path) -> None:
    # code inside plants the chain (and a plain link out) in the destination
    r = sbx.exec(f"mkdir -p /home/user/p/q/up /tmp/out && cd /home/user/p/q/up && {CHAIN} "
                 "&& ln -s /tmp/out out && echo planted")
    assert r.stdout.strip() == "planted", r.stderr
    outside = ("/home/user/p/q/pwned /home/user/p/pwned /home/user/pwned /tmp/out/pwned "
               "/home/user/p/q/d/pwned")
    # the SDK's archive has directory entries: they replace the links
    src = tmp_path / "src"
    for d in ("x1", "x2", "out"):
        (src / d).mkdir(parents=True)
        (src / d / "pwned").write_text("pwned")
    n = sbx.files.upload_dir(src, "/home/user/p/q/up")
    assert n["files"] == 3, n
    r = sbx.exec(f"ls {outside} 2>&1; test -d /home/user/p/q/up/x2 && ! test -L "
                 "/home/user/p/q/up/x2 && cat /home/user/p/q/up/x2/pwned")
    assert r.stdout.count("No such file") == 5 and r.stdout.endswith("pwned"), r.stdout
    # a crafted archive naming files through links that stay on disk: refused at the link
    sbx.exec("cd /home/user/p/q/up && rm -rf x1 x2 out && ln -s a/.. x1 && ln -s x1/.. x2 "
             "&& ln -s /tmp/out out")
    for name in ("x2/pwned", "x3/pwned", "out/pwned", "x1/d/pwned"):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            info = tarfile.TarInfo(name)
            info.size = 6
            tf.addfile(info, io.BytesIO(b"pwned\n"))
        with daemon.client() as c:
            resp = c.put(f"/sandboxes/{sbx.id}/files/tar", params={"path": "/home/user/p/q/up"},
                         content=buf.getvalue())
        assert resp.status_code in (409, 422), resp.text
        assert "never followed" in resp.json()["error"]["message"], resp.text
    r = sbx.exec(f"ls {outside} 2>&1")
    assert r.stdout.count("No such file") == 5, r.stdout


# ---- 8: build contexts -----------------------------------------------------------------------
def cve_2025_4517_context(dest_len: int, up: int, name: str) -> bytes:
    """The published shape of the CVE-2025-4517 bypass: 16 links to long directory names
    whose resolved path passes PATH_MAX, so ``os.path.realpath`` (the ``data`` filter's
    check) stops expanding; the kernel follows them all. ``escape`` then leads ``up``
    levels above the extraction directory (``dest_len``: its path's length + 1), and
    ``escape/<name>`` is written there."""
    steps = "abcdefghijklmnop"
    comp = "d" * ((4096 - dest_len) // (len(steps) + 1))
    buf = io.BytesIO()

    def add(tar: tarfile.TarFile, name: str, kind: bytes, link: str = "",
            data: bytes | None = None) -> None:
        info = tarfile.TarInfo(name)
        info.type, info.linkname = kind, link
        info.size = len(data) if data is not None else 0
        tar.addfile(info, io.BytesIO(data) if data is not None else None)

    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        add(tar, "Dockerfile", tarfile.REGTYPE, data=b"FROM scratch\nCOPY Dockerfile /\n")
        path = ""
        for step in steps:
            add(tar, os.path.join(path, comp), tarfile.DIRTYPE)
            add(tar, os.path.join(path, step), tarfile.SYMTYPE, comp)
            path = os.path.join(path, comp)
        linkpath = os.path.join("/".join(steps), "l" * 254)
        add(tar, linkpath, tarfile.SYMTYPE, "../" * len(steps))
        add(tar, "escape", tarfile.SYMTYPE, linkpath + "/.." * up)
        add(tar, "escape/" + name, tarfile.REGTYPE, data=b"written outside\n")
    return buf.getvalue()


def test_build_context_cve_2025_4517_is_refused(daemon: Daemon, tmp_path: Path) -> None:
    name = f"pwned-{secrets.token_hex(4)}"
    # the daemon unpacks into $CPUOS_HOME/uploads/<16 hex>/context: escape leads to $HOME
    dest_len = len(str(daemon.home / "uploads" / ("0" * 16) / "context")) + 1
    raw = cve_2025_4517_context(dest_len, 3, name)
    # the attack is real: tarfile's own data filter, on this interpreter, writes it
    probe = tmp_path / "h" / "uploads" / ("0" * 16) / "context"
    probe.mkdir(parents=True)
    probe_raw = cve_2025_4517_context(len(str(probe)) + 1, 3, name)
    data_filter = getattr(tarfile, "data_filter", None)
    if data_filter is not None:
        with tarfile.open(fileobj=io.BytesIO(probe_raw)) as tf:
            try:
                tf.extractall(probe, filter=data_filter)
            except tarfile.TarError:
                pass
        print("this Python's data filter wrote outside:", (tmp_path / "h" / name).exists())
    with daemon.client() as c:
        r = c.post("/templates/build", params={"file": "Dockerfile", "name": "ctx-attack"},
                   content=raw)
    assert r.status_code == 422, r.text[:500]
    err = r.json()["error"]
    assert err["code"] == "invalid_argument" and "link" in err["message"], err
    assert "entry '" in err["message"], err  # names the entry
    assert not (daemon.home / name).exists()
    assert not list(daemon.home.rglob(name))
    uploads = daemon.home / "uploads"
    assert not uploads.exists() or not any(uploads.iterdir())  # the upload is removed
    # links of any kind, devices, '..' and absolute names: refused the same way
    for entry, why in ((("a", tarfile.SYMTYPE, "b"), "symbolic link"),
                       (("h", tarfile.LNKTYPE, "Dockerfile"), "hard link"),
                       (("c", tarfile.CHRTYPE, ""), "not a file"),
                       (("../x", tarfile.REGTYPE, ""), "climbs out"),
                       (("/x", tarfile.REGTYPE, ""), "absolute")):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            df = tarfile.TarInfo("Dockerfile")
            df.size = 13
            tar.addfile(df, io.BytesIO(b"FROM scratch\n"))
            info = tarfile.TarInfo(entry[0])
            info.type, info.linkname = entry[1], entry[2]
            tar.addfile(info)
        with daemon.client() as c:
            r = c.post("/templates/build", params={"file": "Dockerfile", "name": "ctx-attack"},
                       content=buf.getvalue())
        assert r.status_code == 422 and why in r.json()["error"]["message"], (why, r.text)


# ---- 11: a 1 TiB sparse file -----------------------------------------------------------------
TIB = 1 << 40


@pytest.fixture
def sparse(sbx: Sandbox) -> Sandbox:
    r = sbx.exec("truncate -s 1T /work/big && mkdir -p /work/bigdir && echo small > "
                 "/work/bigdir/a.txt && truncate -s 1T /work/bigdir/b.bin && "
                 "head -c 3145728 /dev/urandom > /work/three.bin && stat -c %s /work/big")
    assert r.stdout.strip() == str(TIB), r
    return sbx


def _rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def test_sparse_file_read_and_download(sparse: Sandbox, daemon: Daemon, tmp_path: Path
                                       ) -> None:
    peak = _rss_peak()
    with pytest.raises(InvalidArgument) as e:
        sparse.files.read("/work/big")
    assert e.value.code == "too_large" and e.value.status == 413, e.value
    assert str(TIB) in e.value.message  # the daemon refused it up front, by its size
    local = tmp_path / "big"
    with pytest.raises(InvalidArgument) as e:
        sparse.files.download("/work/big", local)
    assert e.value.code == "too_large" and not local.exists()
    # no SDK limit: the daemon's own bound (CPUOS_MAX_READ_BYTES, 64 GiB) still holds
    with pytest.raises(InvalidArgument) as e:
        sparse.files.read("/work/big", max_bytes=None)
    assert e.value.code == "too_large" and "over the limit of" in e.value.message
    # a plain HTTP client: a 413 with a JSON body, never a 1 TiB Content-Length
    with daemon.client() as c:
        r = c.get(f"/sandboxes/{sparse.id}/files", params={"path": "/work/big"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"
    # a smaller limit for a real file, and within it
    with pytest.raises(InvalidArgument):
        sparse.files.read("/work/three.bin", max_bytes=1 << 20)
    assert len(sparse.files.read("/work/three.bin", max_bytes=3 << 20)) == 3 << 20
    with pytest.raises(InvalidArgument, match="max_bytes"):
        sparse.files.read("/work/big", max_bytes=-1)
    assert _rss_peak() - peak < 256 << 20


class _SpoolSpy:
    """tempfile.TemporaryFile, recording the largest size of each file it made."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.files: list[IO[bytes]] = []
        self.sizes: list[int] = []

    def __call__(self, *a: Any, **kw: Any) -> IO[bytes]:
        f: IO[bytes] = self.real(*a, **kw)
        spy = self
        real_close = f.close

        def close() -> None:
            if not f.closed:
                spy.sizes.append(os.fstat(f.fileno()).st_size)
            real_close()

        f.close = close  # type: ignore[method-assign]
        self.files.append(f)
        return f


@pytest.fixture
def spool(monkeypatch: pytest.MonkeyPatch) -> Iterator[_SpoolSpy]:
    spy = _SpoolSpy(tempfile.TemporaryFile)
    monkeypatch.setattr(tempfile, "TemporaryFile", spy)
    yield spy


def test_sparse_file_download_dir(sparse: Sandbox, daemon: Daemon, tmp_path: Path,
                                  spool: _SpoolSpy) -> None:
    peak = _rss_peak()
    dest = tmp_path / "dl"
    with pytest.raises(InvalidArgument) as e:
        sparse.files.download_dir("/work/bigdir", dest)
    assert e.value.code == "too_large" and "b.bin" in e.value.message, e.value
    assert not dest.exists()  # nothing written
    assert spool.sizes and max(spool.sizes) < 8 << 20, spool.sizes  # refused at its header
    # a limit below a real file's size: refused at that header too; a limit above: fine
    sparse.exec("mkdir -p /work/three && mv /work/three.bin /work/three/")
    with pytest.raises(InvalidArgument, match=r"three\.bin"):
        sparse.files.download_dir("/work/three", dest, max_bytes=1 << 20)
    assert not dest.exists()
    assert sparse.files.download_dir("/work/three", dest, max_bytes=4 << 20) > 3 << 20
    assert (dest / "three.bin").stat().st_size == 3 << 20
    assert _rss_peak() - peak < 256 << 20


def test_daemon_cuts_a_tar_stream_at_max_bytes(sparse: Sandbox, daemon: Daemon) -> None:
    # the directory's tar has no declared size: the daemon counts and cuts it
    got = 0
    frames: list[dict[str, Any]] = []
    dec = P.FrameDecoder()
    with daemon.client() as c, c.stream(
            "GET", f"/sandboxes/{sparse.id}/files/tar",
            params={"path": "/work/bigdir", "max_bytes": 1 << 20},
            headers={"Accept": P.CONTENT_TYPE}) as r:
        assert r.status_code == 200
        for chunk in r.iter_raw():
            for h, payload in dec.feed(chunk):
                got += len(payload)
                if h["t"] != "data":
                    frames.append(dict(h))
    assert [f["t"] for f in frames] == ["error"] and frames[0]["code"] == "too_large", frames
    assert got <= 1 << 20
    # and the sandbox is fine afterwards (its agent was told to stop)
    assert sparse.exec("echo ok").stdout == "ok\n"


def test_cli_get_is_bounded_too(sparse: Sandbox, daemon: Daemon, tmp_path: Path) -> None:
    import subprocess
    import sys

    cli = [str(Path(sys.executable).parent / "cpuos"), "files", "get", sparse.id]
    env = {**os.environ, "CPUOS_API_URL": daemon.url, "CPUOS_API_KEY": daemon.key}
    for args in (["/work/big", str(tmp_path / "big")], ["/work/big"],
                 ["-r", "/work", str(tmp_path / "dir")],
                 ["--max-size", "1MiB", "/work/three.bin", str(tmp_path / "three")]):
        r = subprocess.run([*cli, *args], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and "too_large" in r.stderr, (args, r)
        assert len(r.stderr.strip().splitlines()) == 1 and not r.stdout, r
    assert not any(tmp_path.iterdir())
    r = subprocess.run([*cli, "--max-size", "4MiB", "/work/three.bin", str(tmp_path / "three")],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and (tmp_path / "three").stat().st_size == 3 << 20, r
