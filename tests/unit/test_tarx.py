"""cpuos_agent.tarx: the one archive checker and writer (agent upload_dir, SDK download_dir,
daemon build contexts). The rules are checked member by member; the writer is run on a
real directory with symlinks planted on disk (the way an earlier extraction, or code in a
sandbox, leaves them) and must never write, chmod or create through one; the stream scanner
agrees with tarfile and refuses an oversized entry at its header."""

from __future__ import annotations

import io
import os
import random
import stat
import tarfile
from pathlib import Path

import pytest

from cpuos_agent import tarx

Entry = tuple[str, str, str | bytes]  # (name, kind: file|dir|sym|hard|fifo|dev, data/target)


def archive(*entries: Entry, fmt: int = tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for name, kind, data in entries:
            info = tarfile.TarInfo(name)
            info.mode = 0o644
            if kind == "dir":
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tf.addfile(info)
            elif kind in ("sym", "hard"):
                info.type = tarfile.SYMTYPE if kind == "sym" else tarfile.LNKTYPE
                info.linkname = str(data)
                tf.addfile(info)
            elif kind == "fifo":
                info.type = tarfile.FIFOTYPE
                tf.addfile(info)
            elif kind == "dev":
                info.type = tarfile.CHRTYPE
                tf.addfile(info)
            else:
                raw = data if isinstance(data, bytes) else data.encode()
                info.size = len(raw)
                tf.addfile(info, io.BytesIO(raw))
    return buf.getvalue()


def members(raw: bytes, **kw: object) -> list[tuple[tarfile.TarInfo, str]]:
    with tarfile.open(fileobj=io.BytesIO(raw)) as tf:
        return tarx.check_members(tf, **kw)  # type: ignore[arg-type]


def extract(raw: bytes, dest: Path) -> dict[str, int]:
    with tarfile.open(fileobj=io.BytesIO(raw)) as tf:
        return tarx.extract_members(tf, tarx.check_members(tf), str(dest))


@pytest.mark.parametrize("entries, why", [
    ([("../x", "file", "x")], "climbs out"),
    ([("/etc/x", "file", "x")], "absolute path"),
    ([("l", "sym", "/etc")], "absolute target"),
    ([("l", "sym", "../x")], "has '..'"),
    ([("d/l", "sym", "x/../y")], "has '..'"),
    # the chain that climbs a level per link while each target looks inside as text
    ([("a", "sym", "."), ("x1", "sym", "a/..")], "has '..'"),
    ([("a", "sym", "sub"), ("x", "sym", "a/f")], "points through the link 'a'"),
    ([("a", "sym", "sub"), ("a/f", "file", "x")], "goes through a link"),
    ([("a/f", "file", "x"), ("a", "sym", "sub")], "goes through a link"),  # link after
    ([("h", "hard", "nothere")], "not an earlier file"),
    ([("h", "hard", "../../etc/passwd")], "not an earlier file"),
    ([("d", "dir", ""), ("h", "hard", "d")], "not an earlier file"),
    ([("p", "fifo", "")], "not a file, directory or link"),
    ([("c", "dev", "")], "not a file, directory or link"),
])
def test_refused(entries: list[Entry], why: str) -> None:
    with pytest.raises(tarx.Refused, match=why):
        members(archive(*entries))


def test_links_allowed_and_contexts_refuse_them() -> None:
    ok = archive(("d", "dir", ""), ("d/f", "file", "x"), ("d/l", "sym", "f"),
                 ("top", "sym", "d/f"), ("self", "sym", "."), ("h", "hard", "d/f"))
    assert [rel for _, rel in members(ok)] == ["d", "d/f", "d/l", "top", "self", "h"]
    with pytest.raises(tarx.Refused, match="symbolic link"):
        members(ok, links=False)
    with pytest.raises(tarx.Refused, match="hard link"):
        members(archive(("f", "file", "x"), ("h", "hard", "f")), links=False)


def test_limits() -> None:
    raw = archive(*[(f"f{i}", "file", "x" * 10) for i in range(5)])
    assert len(members(raw, max_bytes=50)) == 5
    with pytest.raises(tarx.TooBig):
        members(raw, max_bytes=49)
    with pytest.raises(tarx.Refused, match="more than 4 entries"):
        members(raw, max_members=4)


def test_sparse_members_are_refused() -> None:
    # a GNU sparse member declares a size its data does not hold: a small archive that
    # would write a huge file
    info = tarfile.TarInfo("s")
    info.type = tarfile.GNUTYPE_SPARSE
    with pytest.raises(tarx.Refused, match="sparse"):
        tarx.check_type(info)
    buf = io.BytesIO()  # a pax sparse member (GNU.sparse.* records)
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        info = tarfile.TarInfo("s")
        info.size = 1
        info.pax_headers = {"GNU.sparse.size": str(1 << 40), "GNU.sparse.map": "0,1"}
        tf.addfile(info, io.BytesIO(b"x"))
    pax = buf.getvalue()
    scan = tarx.TarScanner()
    with pytest.raises(tarx.Refused, match="sparse"):
        scan.feed(pax)
    with pytest.raises(tarx.Refused, match="sparse"):
        members(pax)


def test_round_trip(tmp_path: Path) -> None:
    raw = archive(("d", "dir", ""), ("d/f", "file", b"data"), ("d/l", "sym", "f"),
                  ("h", "hard", "d/f"), ("d/e/deep", "file", "y"))
    n = extract(raw, tmp_path / "out")
    assert n == {"files": 2, "dirs": 1, "links": 2, "bytes": 5}
    out = tmp_path / "out"
    assert (out / "d" / "f").read_bytes() == b"data"
    assert os.readlink(out / "d" / "l") == "f"
    assert (out / "h").stat().st_ino == (out / "d" / "f").stat().st_ino
    assert stat.S_IMODE((out / "d").stat().st_mode) == 0o755
    assert stat.S_IMODE((out / "d" / "f").stat().st_mode) == 0o644


@pytest.fixture
def planted(tmp_path: Path) -> tuple[Path, Path]:
    """dest with links already on disk (an earlier extraction's, or a sandbox's): the
    chain that climbs out, and a plain link to a directory outside."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_text("original")
    outside.chmod(0o755)
    dest = tmp_path / "a" / "b" / "dest"
    dest.mkdir(parents=True)
    os.symlink(".", dest / "a")
    os.symlink("a/..", dest / "x1")
    os.symlink("x1/..", dest / "x2")
    os.symlink(str(outside), dest / "out")
    return dest, outside


@pytest.mark.parametrize("name", ["out/victim", "out/new", "x2/x", "x1/b/new", "out/d/new"])
def test_never_writes_through_a_link_on_disk(planted: tuple[Path, Path], name: str) -> None:
    dest, outside = planted
    before = sorted(p.name for p in outside.parent.rglob("*") if "dest" not in p.parts)
    with pytest.raises(OSError, match="a symlink or not a directory on the way"):
        extract(archive((name, "file", "pwned")), dest)
    assert (outside / "victim").read_text() == "original"
    assert sorted(p.name for p in outside.parent.rglob("*") if "dest" not in p.parts) == before


def test_replaces_links_instead_of_following(planted: tuple[Path, Path]) -> None:
    dest, outside = planted
    # a file, a directory (with a mode) and a link at names that are links on disk: the
    # link itself is replaced; nothing outside is written, created or chmod-ed
    extract(archive(("out", "dir", ""), ("x2", "file", "mine"), ("x1", "sym", "x2")), dest)
    assert (dest / "out").is_dir() and not (dest / "out").is_symlink()
    assert (dest / "x2").read_text() == "mine" and os.readlink(dest / "x1") == "x2"
    assert stat.S_IMODE(outside.stat().st_mode) == 0o755
    assert (outside / "victim").read_text() == "original"


def test_hard_link_source_is_resolved_beneath(planted: tuple[Path, Path]) -> None:
    dest, outside = planted
    # the source's parent is a link on disk (pointing outside): refused, not linked
    raw = archive(("out/victim", "file", "x"), ("h", "hard", "out/victim"))
    with pytest.raises(OSError):
        extract(raw, dest)
    assert not (dest / "h").exists() and (outside / "victim").read_text() == "original"


def test_scanner_matches_tarfile() -> None:
    rng = random.Random(7)
    entries: list[Entry] = [("d", "dir", "")]
    for i in range(60):
        name = "d/" + "n" * rng.choice([1, 90, 120, 300]) + str(i)  # ustar, prefix, pax names
        entries.append((name, "file", os.urandom(rng.choice([0, 1, 511, 512, 513, 3000]))))
    entries.append(("d/l" + "k" * 200, "sym", "t" * 150))
    for fmt in (tarfile.PAX_FORMAT, tarfile.GNU_FORMAT):
        raw = archive(*entries, fmt=fmt)
        want = sum(len(d) for _, k, d in entries if k == "file")
        for step in (1, 7, 512, 4096, len(raw)):
            scan = tarx.TarScanner()
            for i in range(0, len(raw), step):
                scan.feed(raw[i:i + step])
            scan.close()
            assert (scan.members, scan.declared) == (len(entries), want)


def test_scanner_refuses_at_the_header() -> None:
    # a 1 TiB file (a pax size record): refused after its header, before its data
    info = tarfile.TarInfo("big")
    info.size = 1 << 40
    head = info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
    scan = tarx.TarScanner(max_bytes=1 << 30)
    with pytest.raises(tarx.TooBig):
        scan.feed(head)
    scan = tarx.TarScanner()
    scan.feed(head + b"\0" * 4096)  # no limit: its data is passed over, not kept
    assert scan.declared == 1 << 40 and len(scan._buf) == 0
    with pytest.raises(tarx.Refused, match="cut short"):
        scan.close()
    for bad in (archive(("../x", "file", "x")), archive(("l", "sym", "/etc")),
                archive(("p", "fifo", "")), b"not a tar" * 100):
        with pytest.raises(tarx.Refused):
            tarx.TarScanner().feed(bad)
    with pytest.raises(tarx.Refused, match="cut short"):
        tarx.TarScanner().close()  # nothing at all
