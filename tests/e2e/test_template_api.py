"""Templates through the API, as the CLI and SDK use them (the CLI imports no server code):
an image tarball uploaded and built with its log streamed back, listed, removed; bad
sources answered 4xx before anything is built; builds refused to non-admin keys and while
another runs; a client that leaves mid-build stops the build and leaves nothing behind."""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from cpuos import Conflict, InvalidArgument, NotFound, PermissionDenied, Templates
from cpuos.cli import main as cli
from support.daemon import Daemon, e2e_unavailable, mounts_under, new_daemon, wait_until

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tdaemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon with a template directory of its own (the shared cache is not touched)."""
    why = e2e_unavailable()
    if why:
        pytest.skip(why)
    tdir = tmp_path_factory.mktemp("templates")
    d = new_daemon(CPUOS_TEMPLATES_DIR=str(tdir), CPUOS_POOL_SIZE="0")
    d.start()
    yield d
    assert not d.teardown(False)


def _tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for name, raw in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(raw), 0o755
            t.addfile(info, io.BytesIO(raw))
    return buf.getvalue()


def docker_save(path: Path, python3: bool = True) -> Path:
    layer = _tar({"usr/bin/python3": b"#!/bin/sh\n", "etc/hello": b"hi\n"} if python3
                 else {"etc/hello": b"hi\n"})
    cfg = {"config": {"Env": ["PATH=/usr/bin:/bin"], "WorkingDir": "/app", "User": "nobody"}}
    path.write_bytes(_tar({
        "l0/layer.tar": layer, "cfg.json": json.dumps(cfg).encode(),
        "manifest.json": json.dumps([{"Config": "cfg.json", "RepoTags": ["x:1"],
                                      "Layers": ["l0/layer.tar"]}]).encode()}))
    return path


def templates_dir(d: Daemon) -> Path:
    return Path(d.extra_env["CPUOS_TEMPLATES_DIR"])


def no_leftovers(d: Daemon) -> bool:
    uploads = d.home / "uploads"
    tdir = templates_dir(d)
    return ((not uploads.exists() or not any(uploads.iterdir()))
            and not list(tdir.glob(".build-*")) and not mounts_under(tdir)
            and not _build_children(d))


def _build_children(d: Daemon) -> list[int]:
    assert d.proc is not None
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_bytes()
            cmd = (p / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(b")", 1)[1].split()[1])
        if ppid == d.proc.pid and b"template\0build" in cmd:
            out.append(int(p.name))
    return out


def test_oci_build_list_remove(tdaemon: Daemon, tmp_path: Path) -> None:
    tar = docker_save(tmp_path / "img.tar")
    lines: list[str] = []
    with Templates(**tdaemon.sdk_kwargs()) as t:
        info = t.build_oci(tar, name="tiny", on_log=lines.append)
        assert info.name == "tiny" and info.source == "oci" and not info.cached
        assert (info.workdir, info.user) == ("/app", "nobody")
        assert Path(str(info.rootfs), "etc/hello").read_text() == "hi\n"
        assert any("etc/hello" in x or "layer" in x for x in lines), lines
        assert t.build_oci(tar, name="tiny").cached  # same bytes: the cached build
        assert [i.name for i in t.list()] == ["tiny"]
        assert t.get("tiny").digest == info.digest
        gone = t.remove("tiny")
        assert gone["paths"] >= 2
        with pytest.raises(NotFound):
            t.get("tiny")
        with pytest.raises(NotFound):
            t.remove("tiny")
    assert no_leftovers(tdaemon)


def test_bad_sources_are_4xx_before_building(tdaemon: Daemon, tmp_path: Path) -> None:
    with Templates(**tdaemon.sdk_kwargs()) as t:
        with pytest.raises(InvalidArgument, match="no built-in template 'nosuch'"):
            t.build("nosuch")
        spec = tmp_path / "x.toml"
        spec.write_text('name = "x"\nbogus = 1\n')
        with pytest.raises(InvalidArgument, match="bogus"):
            t.build(spec)
        (tmp_path / "Dockerfile").write_text("FROM debian:bookworm\nADD x /x\n")
        with pytest.raises(InvalidArgument, match="Dockerfile:2:") as bad:
            t.build(tmp_path / "Dockerfile")
        # named as in the client's context: no daemon path in the answer
        assert str(bad.value).startswith("Dockerfile:2:"), str(bad.value)
        assert "uploads" not in str(bad.value) and str(tdaemon.home) not in str(bad.value)
        with pytest.raises(InvalidArgument, match="python3"):
            t.build_oci(docker_save(tmp_path / "nopy.tar", python3=False), name="nopy")
        with pytest.raises(InvalidArgument, match="could not be opened"):
            t.build_oci(spec, name="junk")
    with tdaemon.client() as c:
        r = c.post("/templates/build", params={"file": "../etc/passwd"},
                   content=_tar({"a": b"x"}))
        assert r.status_code == 422 and "relative path" in r.json()["error"]["message"]
        r = c.post("/templates/build", params={"builtin": "python", "oci": "true"})
        assert r.status_code == 422
    assert no_leftovers(tdaemon)
    assert not [p for p in templates_dir(tdaemon).iterdir() if p.is_dir()]


def test_cli_goes_through_the_api(tdaemon: Daemon, tmp_path: Path) -> None:
    runner = CliRunner()
    api = ["--api-url", tdaemon.url, "--api-key", tdaemon.key]
    r = runner.invoke(cli.app, ["template", "build", "nosuch", *api])
    assert r.exit_code == 1
    assert r.stderr.strip().startswith("error: invalid_argument: no built-in template")
    tar = docker_save(tmp_path / "img.tar")
    r = runner.invoke(cli.app, ["template", "build", "--oci", str(tar), "--name", "clitpl",
                                "--json", *api])
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["name"] == "clitpl"
    r = runner.invoke(cli.app, ["template", "ls", *api])
    assert r.exit_code == 0 and "clitpl" in r.stdout
    r = runner.invoke(cli.app, ["template", "rm", "../etc", *api])
    assert r.exit_code != 0
    r = runner.invoke(cli.app, ["template", "rm", "clitpl", *api])
    assert r.exit_code == 0, r.stderr
    r = runner.invoke(cli.app, ["template", "rm", "clitpl", *api])
    assert r.exit_code == 1 and r.stderr.startswith("error: not_found:")


def test_only_the_admin_builds(tdaemon: Daemon, tmp_path: Path) -> None:
    with tdaemon.client() as c:
        key = c.post("/workspaces", json={"name": "tpl-user"}).json()["key"]
    with Templates(**tdaemon.sdk_kwargs(key)) as t:
        assert t.list() == []  # every workspace may look
        with pytest.raises(PermissionDenied):
            t.build_oci(docker_save(tmp_path / "img.tar"), name="mine")
        with pytest.raises(PermissionDenied):
            t.remove("python")
    assert no_leftovers(tdaemon)


def test_client_leaving_mid_build_stops_it(tdaemon: Daemon, tmp_path: Path) -> None:
    """A spec build (mmdebstrap) whose client disconnects once the log has started: the
    build process is ended, its upload and half-made tree removed, no mount left; a second
    build meanwhile is refused (one at a time)."""
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "slow.toml").write_text('name = "slow"\nsuite = "bookworm"\n'
                                   'run = ["sleep 600"]\n')
    body = _tar({"slow.toml": (ctx / "slow.toml").read_bytes()})
    with httpx.Client(base_url=tdaemon.url, timeout=120,
                      headers={"Authorization": f"Bearer {tdaemon.key}"}) as c:
        with c.stream("POST", "/templates/build", params={"file": "slow.toml"},
                      content=body) as r:
            assert r.status_code == 200, r.read()
            lines = r.iter_lines()
            assert json.loads(next(lines)) == {"started": {"name": "slow", "source": "spec"}}
            assert "log" in json.loads(next(lines))
            assert _build_children(tdaemon)
            with Templates(**tdaemon.sdk_kwargs()) as t, pytest.raises(Conflict):
                t.build_oci(docker_save(tmp_path / "img.tar"), name="second")
        # the response is closed here: the client has gone
    wait_until(lambda: no_leftovers(tdaemon), "the abandoned build cleaned up", timeout=90)
    assert not os.path.exists(templates_dir(tdaemon) / "slow.json")
    with Templates(**tdaemon.sdk_kwargs()) as t:  # the next build may start
        assert t.build_oci(docker_save(tmp_path / "img.tar"), name="after").name == "after"
        t.remove("after")
