"""The snapshot store (issue 24): where paused sandboxes', forks' and templates' checkpoint
images are kept, so that a paused sandbox resumes on any node.

``CPUOS_SNAPSHOT_STORE``:

- unset: ``local``, this node's ``$CPUOS_HOME/snapshots`` (``CPUOS_SNAPSHOTS_DIR``), as
  today: runsc restores from it without a copy;
- ``file:///path`` or ``/path``: ``shared``, a directory every node mounts (files checked by
  SHA-256 when fetched to local disk);
- ``s3://bucket/prefix``: S3-compatible object storage (cpuosd.snapstore.s3; the
  ``cluster`` extra installs boto3).

Interface: cpuosd.snapstore.base.SnapshotStore; what a snapshot needs of the node that
restores it: cpuosd.snapstore.facts. The intended pause / resume flow is in docs/DEPLOY.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from .base import (Manifest, SnapshotCorrupt, SnapshotError, SnapshotMissing, SnapshotStore,
                   check_key)
from .directory import DirectorySnapshotStore

if TYPE_CHECKING:
    from ..config import ClusterConfig

__all__ = ["DirectorySnapshotStore", "Manifest", "SnapshotCorrupt", "SnapshotError",
           "SnapshotMissing", "SnapshotStore", "check_key", "open_snapshot_store"]


def open_snapshot_store(local_dir: Path, url: str | None = None,
                        cfg: ClusterConfig | None = None) -> SnapshotStore:
    """The store ``url`` names (``Config.cluster.snapshot_store``; S3's settings from
    ``cfg``, default none); unset: ``local_dir``."""
    url = (url or "").strip()
    if not url:
        return DirectorySnapshotStore(local_dir)
    if url.startswith("s3://"):
        from .s3 import S3SnapshotStore

        return S3SnapshotStore.from_url(url, cfg)
    if url.startswith("file://"):
        path = urlparse(url).path
    elif url.startswith("/"):
        path = url
    else:
        raise ValueError(f"CPUOS_SNAPSHOT_STORE must be s3://bucket/prefix, file:///path or "
                         f"/path, not {url!r}")
    return DirectorySnapshotStore(Path(path), shared=True)
