"""Snapshots in S3-compatible object storage (``CPUOS_SNAPSHOT_STORE=s3://bucket/prefix``).

Objects (``<prefix>/<key>/...``):

- ``v-<version>/<file>``: the files of one upload of the key (``version``: time and random);
  large files go up in parts (``CPUOS_S3_PART_MIB``, default 64 MiB, ``CPUOS_S3_CONCURRENCY``
  parts at once, 4) through boto3's transfer manager (s3transfer), which retries failed
  parts; each carries its SHA-256 as object metadata, and botocore adds a CRC of each request
  body, which the server checks.
- ``manifest.json``: written last, naming the version and each file's size and SHA-256; a
  PUT replaces it atomically, so a reader sees the old snapshot or the new one, never a mix.
  The version it no longer names is deleted after.

A get downloads into a temporary directory beside ``dest``, checks every file's size and
SHA-256 against the manifest (SnapshotCorrupt otherwise: nothing restores from it), then
renames it into place. A put or get cancelled part way stops its transfers and deletes what
it made. ``sweep`` removes versions no manifest names (a node killed mid-upload).

Credentials: ``CPUOS_S3_ACCESS_KEY_ID`` and ``CPUOS_S3_SECRET_ACCESS_KEY`` when set, else
boto3's own chain (``AWS_*`` variables, a web identity token in Kubernetes, ...);
``CPUOS_S3_ENDPOINT`` (MinIO, Ceph, R2, ...: path-style addressing) and ``CPUOS_S3_REGION``
(default us-east-1).
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import boto3
from botocore.config import Config as BotoConfig
from botocore.exceptions import ClientError
from s3transfer.manager import TransferConfig, TransferManager

from .base import (FORK_PREFIX, Manifest, SnapshotCorrupt, SnapshotError, SnapshotMissing,
                   check_file, check_key, manifest_of)
from .directory import Cancelled, run_cancellable

if TYPE_CHECKING:
    from ..config import ClusterConfig

MIB = 1 << 20
MAX_MANIFEST = 16 * MIB
VERSION_RE = re.compile(r"[0-9a-f]{1,16}-[0-9a-f]{8}")


def _missing(e: ClientError) -> bool:
    code = str(e.response.get("Error", {}).get("Code", ""))
    return code in ("404", "NoSuchKey", "NotFound")


class S3SnapshotStore:
    kind = "s3"

    def __init__(self, bucket: str, prefix: str = "", *, client: Any = None,
                 endpoint_url: str | None = None, region: str | None = None,
                 access_key: str | None = None, secret_key: str | None = None,
                 part_size: int = 64 * MIB, concurrency: int = 4) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.part_size = max(5 * MIB, part_size)  # (S3's smallest part)
        self.concurrency = max(1, concurrency)
        self.client = client or boto3.session.Session().client(
            "s3", endpoint_url=endpoint_url, region_name=region or "us-east-1",
            aws_access_key_id=access_key, aws_secret_access_key=secret_key,
            config=BotoConfig(connect_timeout=10, read_timeout=60,
                              retries={"max_attempts": 5, "mode": "standard"},
                              s3={"addressing_style": "path" if endpoint_url else "auto"},
                              max_pool_connections=max(10, 2 * self.concurrency)))

    @classmethod
    def from_url(cls, url: str, cfg: ClusterConfig | None = None) -> S3SnapshotStore:
        """``s3://bucket/prefix`` and the CPUOS_S3_* settings of ``cfg``."""
        from ..config import ClusterConfig

        u = urlparse(url)
        if u.scheme != "s3" or not u.netloc:
            raise ValueError(f"CPUOS_SNAPSHOT_STORE: {url!r} is not s3://bucket/prefix")
        c = cfg or ClusterConfig()
        return cls(u.netloc, u.path, endpoint_url=c.s3_endpoint, region=c.s3_region,
                   access_key=c.s3_access_key_id, secret_key=c.s3_secret_access_key,
                   part_size=c.s3_part_mib * MIB, concurrency=c.s3_concurrency)

    def _base(self, key: str) -> str:
        return f"{self.prefix}/{check_key(key)}/" if self.prefix else f"{check_key(key)}/"

    def _manifest_key(self, key: str) -> str:
        return self._base(key) + "manifest.json"

    def _file_key(self, key: str, version: str, path: str) -> str:
        return f"{self._base(key)}v-{version}/{path}"

    def _tm(self) -> TransferManager:
        return TransferManager(self.client, TransferConfig(
            multipart_threshold=self.part_size, multipart_chunksize=self.part_size,
            max_request_concurrency=self.concurrency))

    @staticmethod
    def _wait(fut: Any, cancel: threading.Event) -> None:
        """A transfer's end, or its cancellation when ``cancel`` is set."""
        while not fut.done():
            if cancel.wait(0.05):
                fut.cancel()
                break
        if cancel.is_set():
            raise Cancelled
        fut.result()

    def local_path(self, key: str) -> Path | None:
        return None

    # ---- put ------------------------------------------------------------------------
    async def put(self, key: str, src: Path, *, move: bool = False) -> Manifest:
        check_key(key)
        m = await run_cancellable(lambda cancel: self._put(key, src, cancel))
        if move:
            await asyncio.to_thread(shutil.rmtree, src, True)
        return m

    def _put(self, key: str, src: Path, cancel: threading.Event) -> Manifest:
        version = f"{int(time.time() * 1000):x}-{secrets.token_hex(4)}"
        m = manifest_of(key, src, digests=True, version=version)
        old = self._read_manifest(key)
        tm = self._tm()
        ok = False
        try:
            for f in m.files:
                if cancel.is_set():
                    raise Cancelled
                self._wait(tm.upload(str(src / f.path), self.bucket,
                                     self._file_key(key, version, f.path),
                                     extra_args={"Metadata": {"sha256": f.sha256 or ""}}),
                           cancel)
            if cancel.is_set():
                raise Cancelled
            self.client.put_object(Bucket=self.bucket, Key=self._manifest_key(key),
                                   Body=m.to_json(), ContentType="application/json")
            ok = True
        finally:
            tm.shutdown(cancel=not ok)
            if not ok:
                self._delete_prefix(f"{self._base(key)}v-{version}/")
        if old is not None and old.version and old.version != version:
            self._delete_prefix(f"{self._base(key)}v-{old.version}/")
        return m

    # ---- get ------------------------------------------------------------------------
    async def get(self, key: str, dest: Path) -> Manifest:
        check_key(key)
        return await run_cancellable(lambda cancel: self._get(key, dest, cancel))

    def _get(self, key: str, dest: Path, cancel: threading.Event) -> Manifest:
        m = self._read_manifest(key)
        if m is None:
            raise SnapshotMissing(f"snapshot {key} is not in s3://{self.bucket}/{self.prefix}")
        if dest.exists():
            raise SnapshotError(f"{dest} exists already")
        tmp = dest.with_name(f".{dest.name}.fetch-{secrets.token_hex(4)}")
        tm = self._tm()
        ok = False
        try:
            tmp.mkdir(mode=0o700)
            for f in m.files:
                (tmp / f.path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                try:
                    self._wait(tm.download(self.bucket, self._file_key(key, m.version, f.path),
                                           str(tmp / f.path)), cancel)
                except ClientError as e:
                    if _missing(e):
                        raise SnapshotMissing(f"snapshot {key}: {f.path} is gone (replaced or "
                                              "deleted meanwhile)") from None
                    raise
                check_file(tmp / f.path, f, key)
            os.rename(tmp, dest)
            ok = True
            return m
        finally:
            tm.shutdown(cancel=not ok)
            if not ok:
                shutil.rmtree(tmp, ignore_errors=True)

    # ---- the rest -------------------------------------------------------------------
    def _read_manifest(self, key: str) -> Manifest | None:
        try:
            r = self.client.get_object(Bucket=self.bucket, Key=self._manifest_key(key))
        except ClientError as e:
            if _missing(e):
                return None
            raise
        body = r["Body"]
        try:
            data = body.read(MAX_MANIFEST + 1)
        finally:
            body.close()
        if len(data) > MAX_MANIFEST:
            raise SnapshotError(f"snapshot {key}: manifest larger than {MAX_MANIFEST} bytes")
        m = Manifest.from_json(data, key)
        if not VERSION_RE.fullmatch(m.version):
            raise SnapshotCorrupt(f"snapshot {key}: the manifest names no valid version")
        return m

    async def manifest(self, key: str) -> Manifest | None:
        return await asyncio.to_thread(self._read_manifest, key)

    async def exists(self, key: str) -> bool:
        def head() -> bool:
            try:
                self.client.head_object(Bucket=self.bucket, Key=self._manifest_key(key))
                return True
            except ClientError as e:
                if _missing(e):
                    return False
                raise

        return await asyncio.to_thread(head)

    async def size(self, key: str) -> int | None:
        m = await self.manifest(key)
        return None if m is None else m.total_bytes

    async def delete(self, key: str) -> None:
        def rm() -> None:
            # the manifest first: from then on the key is absent, whatever is left
            self.client.delete_object(Bucket=self.bucket, Key=self._manifest_key(key))
            self._delete_prefix(self._base(key))

        await asyncio.to_thread(rm)

    def _list(self, prefix: str, on: Callable[[dict[str, Any]], None]) -> None:
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                on(obj)

    def _delete_prefix(self, prefix: str) -> None:
        keys: list[str] = []
        self._list(prefix, lambda o: keys.append(str(o["Key"])))
        for i in range(0, len(keys), 1000):
            self.client.delete_objects(Bucket=self.bucket, Delete={
                "Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})

    def sweep(self, older_than: float = 3600.0) -> list[str]:
        """Delete the versions that no manifest names, older than ``older_than`` s (what a
        put that never finished left): the prefixes removed."""
        base = f"{self.prefix}/" if self.prefix else ""
        versions: dict[tuple[str, str], float] = {}  # (key, version) -> newest object's time

        def seen(o: dict[str, Any]) -> None:
            parts = str(o["Key"])[len(base):].split("/")
            if len(parts) >= 3 and parts[1].startswith("v-"):
                k = (parts[0], parts[1][2:])
                versions[k] = max(versions.get(k, 0.0), o["LastModified"].timestamp())

        self._list(base, seen)
        out, now = [], time.time()
        for (key, version), newest in sorted(versions.items()):
            if now - newest < older_than:
                continue
            try:
                m = self._read_manifest(key)
            except SnapshotError:
                m = None
            if m is None or m.version != version:
                p = f"{self._base(key)}v-{version}/"
                self._delete_prefix(p)
                out.append(p)
            elif key.startswith(FORK_PREFIX) and now - m.created_at >= older_than:
                # a fork's image its fork did not release (an API process that died)
                self.client.delete_object(Bucket=self.bucket, Key=self._manifest_key(key))
                self._delete_prefix(self._base(key))
                out.append(self._base(key))
        return out
