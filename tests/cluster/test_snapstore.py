"""The snapshot store's contract on a local directory, a shared directory and a real S3
server on 127.0.0.1 (moto's, a process of its own): round trips, atomic replacement,
integrity checks, unsafe manifests, cancellation, multipart uploads, sweeping."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support import testbed
from cpuosd.config import Config, ConfigError
from cpuosd.snapstore import (DirectorySnapshotStore, SnapshotCorrupt, SnapshotError,
                              SnapshotMissing, SnapshotStore, open_snapshot_store)
from cpuosd.snapstore.base import MANIFEST
from cpuosd.snapstore.facts import META, cpu_info, incompatibilities, read_meta, write_meta
from cpuosd.snapstore.s3 import S3SnapshotStore

MIB = 1 << 20


@pytest.fixture(params=["local", "shared", pytest.param("s3", marks=pytest.mark.cluster)])
def snap(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SnapshotStore]:
    if request.param == "s3":
        s3: testbed.S3Server = request.getfixturevalue("s3_server")
        bucket = "b-" + secrets.token_hex(4)
        s3.create_bucket(bucket)
        yield S3SnapshotStore(bucket, "snaps", endpoint_url=s3.endpoint,
                              access_key=s3.access_key, secret_key=s3.secret_key,
                              part_size=5 * MIB, concurrency=2)
    else:
        yield DirectorySnapshotStore(tmp_path / "store", shared=request.param == "shared")


def image(d: Path, tag: bytes, big: int = 0) -> Path:
    """A checkpoint-like directory: a few files, one in a subdirectory, facts."""
    d.mkdir(parents=True)
    (d / "checkpoint.img").write_bytes(b"ck-" + tag * 1000)
    (d / "pages.img").write_bytes(os.urandom(big) if big else b"pages-" + tag)
    (d / "sub").mkdir()
    (d / "sub" / "agent.key").write_bytes(b"key-" + tag)
    write_meta(d, {"format": 1, "image_kind": "gvisor-test", "cpu_features": ["sse2"],
                   "tag": tag.decode()})
    return d


def files_of(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file() and p.name != MANIFEST}


def test_put_get_round_trip(snap: SnapshotStore, tmp_path: Path) -> None:
    src = image(tmp_path / "src", b"one")
    want = files_of(src)

    async def go() -> None:
        assert not await snap.exists("sbx-1") and await snap.size("sbx-1") is None
        m = await snap.put("sbx-1", src)
        assert m.meta["tag"] == "one" and m.total_bytes == sum(map(len, want.values()))
        assert {f.path for f in m.files} == set(want)
        assert await snap.exists("sbx-1") and await snap.size("sbx-1") == m.total_bytes
        got = await snap.manifest("sbx-1")
        assert got is not None and got.meta == m.meta
        dest = tmp_path / "restore" / "sbx-1"
        dest.parent.mkdir()
        m2 = await snap.get("sbx-1", dest)
        assert files_of(dest) == want and m2.files == m.files
        assert read_meta(dest) == m.meta
        with pytest.raises(SnapshotError):  # (never over something there)
            await snap.get("sbx-1", dest)
        with pytest.raises(SnapshotMissing):
            await snap.get("sbx-2", tmp_path / "restore" / "sbx-2")
        assert not (tmp_path / "restore" / "sbx-2").exists()
        assert sorted(p.name for p in (tmp_path / "restore").iterdir()) == ["sbx-1"]
        local = snap.local_path("sbx-1")
        if snap.kind == "local":
            assert local is not None and files_of(local) == want
        else:
            assert local is None
        await snap.delete("sbx-1")
        await snap.delete("sbx-1")  # (absent: nothing to do)
        assert not await snap.exists("sbx-1") and await snap.manifest("sbx-1") is None

    asyncio.run(go())
    assert files_of(src) == want  # (put without move leaves the source)


def test_replacing_is_atomic_and_leaves_one_version(snap: SnapshotStore, tmp_path: Path
                                                    ) -> None:
    async def go() -> None:
        await snap.put("sbx-r", image(tmp_path / "a", b"aaa"))
        src = image(tmp_path / "b", b"bbbb")
        want = files_of(src)
        m = await snap.put("sbx-r", src, move=True)
        assert not src.exists() and m.meta["tag"] == "bbbb"
        dest = tmp_path / "out"
        await snap.get("sbx-r", dest)
        assert files_of(dest) == want

    asyncio.run(go())
    if isinstance(snap, S3SnapshotStore):
        keys = [o["Key"] for o in snap.client.list_objects_v2(
            Bucket=snap.bucket, Prefix="snaps/sbx-r/")["Contents"]]
        versions = {k.split("/")[2] for k in keys if "/v-" in k}
        assert len(versions) == 1 and "snaps/sbx-r/manifest.json" in keys
    elif isinstance(snap, DirectorySnapshotStore):
        assert sorted(p.name for p in snap.root.iterdir()) == ["sbx-r"]


def _tamper(snap: SnapshotStore, key: str, path: str, data: bytes) -> None:
    if isinstance(snap, S3SnapshotStore):
        m = snap._read_manifest(key)
        assert m is not None
        snap.client.put_object(Bucket=snap.bucket, Key=snap._file_key(key, m.version, path),
                               Body=data)
    else:
        assert isinstance(snap, DirectorySnapshotStore)
        (snap.root / key / path).write_bytes(data)


def test_a_changed_file_is_refused(snap: SnapshotStore, tmp_path: Path) -> None:
    src = image(tmp_path / "src", b"xyz")
    size = len((src / "checkpoint.img").read_bytes())

    async def go() -> None:
        await snap.put("sbx-c", src)
        if snap.kind != "local":  # same size, other bytes: the digest finds it
            _tamper(snap, "sbx-c", "checkpoint.img", b"X" * size)
            with pytest.raises(SnapshotCorrupt, match="SHA-256"):
                await snap.get("sbx-c", tmp_path / "d1")
        _tamper(snap, "sbx-c", "sub/agent.key", b"short")  # (any store: the size)
        if snap.kind == "local":
            return  # (runsc restores from the node's own directory: no fetch to check)
        with pytest.raises(SnapshotCorrupt):
            await snap.get("sbx-c", tmp_path / "d2")
        assert not (tmp_path / "d1").exists() and not (tmp_path / "d2").exists()
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []

    asyncio.run(go())


@pytest.mark.parametrize("bad", ["../escape", "/etc/passwd", "a/../../b", "./a", ""])
def test_an_unsafe_manifest_writes_nothing(snap: SnapshotStore, tmp_path: Path, bad: str
                                           ) -> None:
    async def go() -> None:
        m = await snap.put("sbx-u", image(tmp_path / "src", b"u"))
        doc = json.loads(m.to_json())
        doc["files"][0]["path"] = bad
        data = json.dumps(doc).encode()
        if isinstance(snap, S3SnapshotStore):
            snap.client.put_object(Bucket=snap.bucket, Key=snap._manifest_key("sbx-u"),
                                   Body=data)
        else:
            assert isinstance(snap, DirectorySnapshotStore)
            (snap.root / "sbx-u" / MANIFEST).write_bytes(data)
        with pytest.raises(SnapshotCorrupt, match="unsafe path"):
            await snap.get("sbx-u", tmp_path / "out" / "sbx-u")
        assert not (tmp_path / "out").exists() and not (tmp_path / "escape").exists()

    asyncio.run(go())


def test_what_is_not_a_snapshot_is_refused(snap: SnapshotStore, tmp_path: Path) -> None:
    src = image(tmp_path / "src", b"l")
    (src / "link").symlink_to("/etc/passwd")

    async def go() -> None:
        with pytest.raises(SnapshotError, match="regular file"):
            await snap.put("sbx-l", src)
        assert not await snap.exists("sbx-l")
        for key in ("../x", "A", ".hidden", "a/b", "x" * 200):
            with pytest.raises(ValueError):
                await snap.put(key, src)

    asyncio.run(go())


def _cancel_when(cond: Any, task: asyncio.Task[Any]) -> asyncio.Task[None]:
    async def watch() -> None:
        while not await asyncio.to_thread(cond):
            await asyncio.sleep(0.02)
        task.cancel()

    return asyncio.ensure_future(watch())


def test_a_cancelled_put_leaves_nothing(snap: SnapshotStore, tmp_path: Path) -> None:
    src = image(tmp_path / "src", b"c", big=96 * MIB)

    def started() -> bool:  # the first file is stored: the put is under way
        if isinstance(snap, S3SnapshotStore):
            r = snap.client.list_objects_v2(Bucket=snap.bucket, Prefix="snaps/sbx-x/")
            return int(r.get("KeyCount", 0)) > 0
        assert isinstance(snap, DirectorySnapshotStore)
        return any((p / "checkpoint.img").exists() for p in snap.root.glob(".incoming-*"))

    async def go() -> None:
        task = asyncio.ensure_future(snap.put("sbx-x", src))
        watcher = _cancel_when(started, task)
        with pytest.raises(asyncio.CancelledError):
            await task
        await watcher
        assert not await snap.exists("sbx-x")

    asyncio.run(go())
    if isinstance(snap, S3SnapshotStore):
        r = snap.client.list_objects_v2(Bucket=snap.bucket, Prefix="snaps/sbx-x/")
        assert int(r.get("KeyCount", 0)) == 0
        ups = snap.client.list_multipart_uploads(Bucket=snap.bucket).get("Uploads", [])
        assert ups == []  # (an interrupted multipart upload is aborted, not left to bill)
    else:
        assert isinstance(snap, DirectorySnapshotStore)
        assert list(snap.root.iterdir()) == []
    assert (src / "pages.img").stat().st_size == 96 * MIB


@pytest.mark.cluster
def test_s3_big_files_go_up_in_parts(s3_server: testbed.S3Server, tmp_path: Path) -> None:
    bucket = "b-" + secrets.token_hex(4)
    s3_server.create_bucket(bucket)
    snap = S3SnapshotStore(bucket, "", endpoint_url=s3_server.endpoint,
                           access_key=s3_server.access_key, secret_key=s3_server.secret_key,
                           part_size=5 * MIB)
    src = image(tmp_path / "src", b"m", big=12 * MIB)

    async def go() -> None:
        m = await snap.put("sbx-big", src)
        head = snap.client.head_object(Bucket=bucket, Key=snap._file_key("sbx-big", m.version,
                                                                        "pages.img"))
        assert head["ETag"].strip('"').endswith("-3")  # three parts
        entry = next(f for f in m.files if f.path == "pages.img")
        assert head["Metadata"]["sha256"] == entry.sha256
        await snap.get("sbx-big", tmp_path / "out")
        assert (tmp_path / "out" / "pages.img").read_bytes() == (src / "pages.img").read_bytes()

    asyncio.run(go())


@pytest.mark.cluster
def test_s3_sweep_removes_what_a_killed_put_left(s3_server: testbed.S3Server,
                                                 tmp_path: Path) -> None:
    bucket = "b-" + secrets.token_hex(4)
    s3_server.create_bucket(bucket)
    snap = S3SnapshotStore(bucket, "p", endpoint_url=s3_server.endpoint,
                           access_key=s3_server.access_key, secret_key=s3_server.secret_key)
    m = asyncio.run(snap.put("sbx-k", image(tmp_path / "src", b"k")))
    # a node killed after uploading files of a new version, before its manifest
    for name in ("checkpoint.img", "pages.img"):
        snap.client.put_object(Bucket=bucket, Key=f"p/sbx-k/v-1-deadbeef/{name}", Body=b"x")
        snap.client.put_object(Bucket=bucket, Key=f"p/sbx-gone/v-2-deadbeef/{name}", Body=b"x")
    assert snap.sweep(older_than=3600) == []  # (too recent: it may still be under way)
    assert sorted(snap.sweep(older_than=0)) == ["p/sbx-gone/v-2-deadbeef/",
                                                "p/sbx-k/v-1-deadbeef/"]
    keys = [o["Key"] for o in snap.client.list_objects_v2(Bucket=bucket)["Contents"]]
    assert all(f"/v-{m.version}/" in k or k.endswith("manifest.json") for k in keys)
    asyncio.run(snap.get("sbx-k", tmp_path / "out"))


@pytest.mark.cluster
def test_s3_sweep_removes_an_old_fork_image(s3_server: testbed.S3Server,
                                            tmp_path: Path) -> None:
    """A fork image (fork-*) its fork never released goes past the bound; a paused
    sandbox's image never does."""
    bucket = "b-" + secrets.token_hex(4)
    s3_server.create_bucket(bucket)
    snap = S3SnapshotStore(bucket, "p", endpoint_url=s3_server.endpoint,
                           access_key=s3_server.access_key, secret_key=s3_server.secret_key)
    asyncio.run(snap.put("fork-sbx-k-0badf00d", image(tmp_path / "f", b"f")))
    asyncio.run(snap.put("sbx-k", image(tmp_path / "k", b"k")))
    assert snap.sweep(older_than=3600) == []
    assert snap.sweep(older_than=0) == ["p/fork-sbx-k-0badf00d/"]
    assert not asyncio.run(snap.exists("fork-sbx-k-0badf00d"))
    keys = [o["Key"] for o in snap.client.list_objects_v2(Bucket=bucket)["Contents"]]
    assert keys and all(k.startswith("p/sbx-k/") for k in keys)
    asyncio.run(snap.get("sbx-k", tmp_path / "out"))


def test_directory_sweep(tmp_path: Path) -> None:
    snap = DirectorySnapshotStore(tmp_path / "s", shared=True)
    left = tmp_path / "s" / ".incoming-sbx-1-abcd"
    left.mkdir()
    (left / "pages.img").write_bytes(b"x")
    assert snap.sweep(3600) == []
    os.utime(left, (time.time() - 7200, time.time() - 7200))
    assert snap.sweep(3600) == [".incoming-sbx-1-abcd"] and not left.exists()


def test_open_snapshot_store(tmp_path: Path) -> None:
    s = open_snapshot_store(tmp_path / "local")
    assert isinstance(s, DirectorySnapshotStore) and s.kind == "local"
    s = open_snapshot_store(tmp_path / "local", f"file://{tmp_path}/shared")
    assert isinstance(s, DirectorySnapshotStore) and s.kind == "shared"
    assert s.root == tmp_path / "shared"
    cfg = Config.from_env({"CPUOS_SNAPSHOT_STORE": "s3://bkt/some/prefix",
                           "CPUOS_S3_ENDPOINT": "http://127.0.0.1:9",
                           "CPUOS_S3_PART_MIB": "16"}).cluster
    s = open_snapshot_store(tmp_path / "local", cfg.snapshot_store, cfg)
    assert isinstance(s, S3SnapshotStore) and (s.bucket, s.prefix) == ("bkt", "some/prefix")
    assert s.part_size == 16 * MIB
    with pytest.raises(ValueError):
        open_snapshot_store(tmp_path, "ftp://x")
    with pytest.raises(ConfigError):
        Config.from_env({"CPUOS_SNAPSHOT_STORE": "ftp://x"})


def test_facts_and_compatibility(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: X\n"
                       "flags\t\t: sse2 avx2 fpu avx2\n\nprocessor\t: 1\nflags\t\t: zzz\n")
    assert cpu_info(cpuinfo) == {"cpu_vendor": "GenuineIntel", "cpu_model": "X",
                                 "cpu_features": ["avx2", "fpu", "sse2"]}
    assert cpu_info()["cpu_features"]  # (this host's)
    snap = {"backend": "gvisor", "image_kind": "k1", "arch": "x86_64",
            "runtime": {"runsc_version": "r1", "platform": "systrap"},
            "cpu_features": ["avx2", "sse2"]}
    host = {**snap, "cpu_features": ["avx2", "avx512f", "sse2"]}
    assert incompatibilities(snap, host) == []
    assert incompatibilities(snap, {**host, "cpu_features": ["sse2"]}) == [
        "CPU features missing here: avx2"]
    why = incompatibilities(snap, {**host, "runtime": {"runsc_version": "r2",
                                                       "platform": "systrap"},
                                   "image_kind": "k2"})
    assert why == ["image_kind k1 here k2", "runsc_version r1 here r2"]
    write_meta(tmp_path, snap)
    assert read_meta(tmp_path) == snap and (tmp_path / META).stat().st_mode & 0o777 == 0o600
