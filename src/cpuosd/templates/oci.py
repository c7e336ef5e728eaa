"""Root filesystems from image tarballs: ``docker save`` output (manifest.json + layer tars)
or an OCI image layout (oci-layout, index.json, blobs/sha256/...).

Layers are applied in order with their whiteouts (``.wh.NAME`` hides NAME of the lower
layers, ``.wh..wh..opq`` empties its directory of them). An image is untrusted input: a
member named with an absolute path or ``..`` is refused, as is a hard link to such a
name; every path is resolved inside the root (a symlink in the image, absolute or not,
means a path in the image, never on the host); device nodes are skipped. Symlinks are
kept as they are: they only mean something inside the sandbox.
"""

from __future__ import annotations

import json
import os
import platform
import posixpath
import re
import shutil
import tarfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from .spec import TemplateError

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
INDEX_TYPES = {"application/vnd.oci.image.index.v1+json",
               "application/vnd.docker.distribution.manifest.list.v2+json"}
MAX_SYMLINKS = 40


def resolve_in_root(root: Path, path: str, *, follow_final: bool = True) -> Path:
    """``root``/``path`` with every symlink on the way resolved as if ``root`` were ``/``
    (absolute targets start again at ``root``; ``..`` stops at ``root``). The result has no
    symlink in it below ``root`` (the last part is one only when ``follow_final`` is false)."""
    todo = [p for p in path.split("/") if p not in ("", ".")]
    done: list[str] = []
    hops = 0
    while todo:
        part = todo.pop(0)
        if part == "..":
            if done:
                done.pop()
            continue
        here = root.joinpath(*done, part)
        if (todo or follow_final) and here.is_symlink():
            hops += 1
            if hops > MAX_SYMLINKS:
                raise TemplateError(f"too many levels of symlinks in {path!r}")
            target = os.readlink(here)
            if target.startswith("/"):
                done = []
            todo = [p for p in target.split("/") if p not in ("", ".")] + todo
            continue
        done.append(part)
    return root.joinpath(*done)


@dataclass
class Image:
    layers: list[str]  # member names in the tarball, bottom layer first
    config: dict[str, Any]  # the image config's "config" (Env, WorkingDir, User, Cmd...)


def image_config(tar_path: Path) -> dict[str, Any]:
    """The image config's "config" section (Env, WorkingDir, User, Cmd...)."""
    with _open(tar_path) as outer:
        return read_image(outer).config


def extract_image(tar_path: Path, root: Path,
                  on_line: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Apply the image's layers to ``root`` (an existing directory); returns its config."""
    with _open(tar_path) as outer:
        image = read_image(outer)
        for i, name in enumerate(image.layers, 1):
            if on_line:
                on_line(f"I: layer {i}/{len(image.layers)}: {name}")
            try:
                with tarfile.open(fileobj=_member_file(outer, name), mode="r:*") as layer:
                    apply_layer(layer, root, on_line)
            except tarfile.ReadError as e:
                raise TemplateError(f"layer {name}: cannot read it ({e}; only plain and "
                                    "gzip layers are supported)") from None
    return image.config


@contextmanager
def _open(tar_path: Path) -> Iterator[tarfile.TarFile]:
    try:
        with tarfile.open(tar_path) as outer:
            yield outer
    except (OSError, tarfile.TarError) as e:
        raise TemplateError(f"{tar_path}: {e}") from None


def read_image(outer: tarfile.TarFile) -> Image:
    """The layer list and config of a ``docker save`` tarball or an OCI layout tarball."""
    names = {m.name.removeprefix("./") for m in outer.getmembers()}
    try:
        if "manifest.json" in names:
            manifest = _json(outer, "manifest.json")
            if not isinstance(manifest, list) or len(manifest) != 1:
                raise TemplateError("manifest.json: want exactly one image in the tarball")
            config = _json(outer, manifest[0]["Config"])
            layers = [str(x) for x in manifest[0]["Layers"]]
        elif "index.json" in names and "oci-layout" in names:
            m = _oci_manifest(outer, _json(outer, "index.json"))
            config = _json(outer, _blob(m["config"]["digest"]))
            layers = [_blob(x["digest"]) for x in m["layers"]]
        else:
            raise TemplateError("not an image tarball: no manifest.json (docker save) and no "
                                "oci-layout + index.json (OCI layout)")
        config = dict(config.get("config") or {})
    except (KeyError, TypeError, AttributeError) as e:
        raise TemplateError(f"malformed image metadata ({type(e).__name__}: {e})") from None
    missing = [x for x in layers if x.removeprefix("./") not in names]
    if missing:
        raise TemplateError(f"layer(s) missing from the tarball: {missing}")
    return Image(layers=layers, config=config)


def _oci_manifest(outer: tarfile.TarFile, index: dict[str, Any]) -> dict[str, Any]:
    """The image manifest an index points at (this machine's platform if it lists several)."""
    for _ in range(4):  # an index may point at a nested index
        entries = index.get("manifests") or []
        arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
        ours = [e for e in entries if (e.get("platform") or {}).get("architecture") in
                (arch, None) and (e.get("platform") or {}).get("os") in ("linux", None)]
        if len(ours) != 1:
            raise TemplateError(f"index.json: want one image for linux/{arch}, found {len(ours)}")
        doc = _json(outer, _blob(ours[0]["digest"]))
        if ours[0].get("mediaType") not in INDEX_TYPES and doc.get("mediaType") not in INDEX_TYPES:
            return dict(doc)
        index = doc
    raise TemplateError("index.json: too many nested indexes")


def _blob(digest: str) -> str:
    if not isinstance(digest, str) or not DIGEST_RE.fullmatch(digest):
        raise TemplateError(f"bad blob digest {digest!r}")
    return "blobs/sha256/" + digest.removeprefix("sha256:")


def _member_file(outer: tarfile.TarFile, name: str) -> IO[bytes]:
    for n in (name, "./" + name):
        try:
            f = outer.extractfile(n)
        except KeyError:
            continue
        if f is not None:
            return f
    raise TemplateError(f"{name!r} is missing from the tarball or is not a file")


def _json(outer: tarfile.TarFile, name: str) -> Any:
    try:
        return json.load(_member_file(outer, name))
    except ValueError as e:
        raise TemplateError(f"{name}: bad JSON ({e})") from None


# ---- one layer -----------------------------------------------------------------------------
def apply_layer(layer: tarfile.TarFile, root: Path,
                on_line: Callable[[str], None] | None = None) -> None:
    members = layer.getmembers()
    for m in members:  # refuse a bad layer before writing anything
        _member_path(m)
    for m in members:  # whiteouts hide what the lower layers put there, not this layer's files
        parent, base = posixpath.split(_member_path(m))
        if base == OPAQUE:
            d = resolve_in_root(root, parent)
            if d.is_dir():
                for child in d.iterdir():
                    _remove(child)
        elif base.startswith(WHITEOUT) and not base.startswith(WHITEOUT + WHITEOUT):
            _remove(resolve_in_root(root, parent) / base.removeprefix(WHITEOUT))
    keep = _RootfsFilter(root, on_line)
    for m in members:
        if posixpath.basename(_member_path(m)).startswith(WHITEOUT):
            continue
        try:
            layer.extract(m, root, numeric_owner=True, filter=keep)
        except (OSError, KeyError, tarfile.TarError) as e:
            raise TemplateError(f"extracting {m.name!r}: {e}") from None


class _RootfsFilter:
    """A tarfile extraction filter for root filesystems: the member's path is resolved inside
    the root and whatever is in its way is removed (so nothing is written through a symlink);
    ownership, modes and symlinks are kept; device nodes are skipped."""

    def __init__(self, root: Path, on_line: Callable[[str], None] | None) -> None:
        self.root = root
        self.on_line = on_line

    def __call__(self, member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
        rel = _member_path(member)
        if not rel:
            return None  # the root directory itself
        if member.ischr() or member.isblk():
            if self.on_line:
                self.on_line(f"I: skipped device node /{rel}")
            return None
        target = resolve_in_root(self.root, posixpath.dirname(rel)) / posixpath.basename(rel)
        if os.path.lexists(target) and not (member.isdir() and target.is_dir()
                                            and not target.is_symlink()):
            _remove(target)
        link = member.linkname
        if member.islnk():  # a hard link names a path in the root too
            link = str(resolve_in_root(self.root, _link_path(member)).relative_to(self.root))
        return member.replace(name=str(target.relative_to(self.root)), linkname=link,
                              deep=False)


def _member_path(m: tarfile.TarInfo) -> str:
    """The member's name relative to the root; refuses absolute names and '..'."""
    name = m.name
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if name.startswith("/") or ".." in parts:
        raise TemplateError(f"refusing layer member {name!r}: it escapes the root")
    if m.islnk():
        _link_path(m)
    base = parts[-1] if parts else ""
    if base.startswith(WHITEOUT) and base.removeprefix(WHITEOUT) in ("", ".", ".."):
        raise TemplateError(f"refusing bad whiteout {name!r}")
    return "/".join(parts)


def _link_path(m: tarfile.TarInfo) -> str:
    link = m.linkname
    if link.startswith("/") or ".." in link.split("/"):
        raise TemplateError(f"refusing hard link {m.name!r} -> {link!r}: it points outside "
                            "the root")
    return link


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    elif os.path.lexists(p):
        p.unlink()
