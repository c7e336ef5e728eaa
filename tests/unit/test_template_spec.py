"""Template specs without mmdebstrap: TOML and Dockerfile parsing and their errors, COPY
sources, the digest, the shared base, image tarball extraction (docker save and OCI
layout, whiteouts, malicious members), and the `cpuos template` commands that need no build."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cpuos.cli import main as cli
from cpuosd.templates.builder import (
    CopySpec,
    TemplateError,
    TemplateSpec,
    base_apt,
    build_from_oci,
    build_steps,
    list_templates,
    remove_template,
    spec_digest,
    template_info,
)
from cpuosd.templates.oci import extract_image, resolve_in_root


def write(p: Path, text: str) -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


# ---- TOML --------------------------------------------------------------------------------
def test_toml_full_spec(tmp_path: Path) -> None:
    write(tmp_path / "app" / "main.py", "print(1)\n")
    p = write(tmp_path / "web.toml", """
name = "web"
apt = ["nodejs"]
pip = ["requests==2.31"]
npm = ["typescript"]
copy = [{src = "app", dest = "/work/app"}]
env = {MODE = "prod"}
workdir = "/srv"
user = "app"
run = ["echo hi"]
start = "python3 -m http.server 8080"

[ready]
port = 8080
timeout = 5
""")
    s = TemplateSpec.load(str(p))
    assert (s.name, s.workdir, s.user, s.env) == ("web", "/srv", "app", {"MODE": "prod"})
    assert s.copy == [CopySpec("app", "/work/app")]
    assert s.ready is not None and (s.ready.port, s.ready.timeout) == (8080, 5.0)
    assert s.copy_sources() == [(tmp_path / "app").resolve()]
    assert base_apt(s)[:1] == ["nodejs"] and {"python3", "python3-pip", "npm"} <= set(base_apt(s))
    labels = [st.label for st in build_steps(s)]
    assert labels == ["base step 1", "base step 2", "pip install", "npm install",
                      "copy app -> /work/app", "run step 1"]
    assert "useradd -m -u 1000" in build_steps(s)[0].cmd and " app" in build_steps(s)[0].cmd


def test_unknown_key_names_key_and_line(tmp_path: Path) -> None:
    p = write(tmp_path / "x.toml", 'name = "x"\napt = ["curl"]\n\nbogus = 1\n')
    with pytest.raises(TemplateError, match=r"x\.toml:4: unknown key 'bogus'"):
        TemplateSpec.load(str(p))
    p = write(tmp_path / "y.toml", 'name = "y"\n[ready]\nport = 1\nwhen = 2\n')
    with pytest.raises(TemplateError, match=r"y\.toml:4: unknown key 'when' in ready"):
        TemplateSpec.load(str(p))
    write(tmp_path / "f", "")
    p = write(tmp_path / "z.toml",
              'name = "z"\ncopy = [\n  {src = "f", dest = "/f", mode = 1},\n]\n')
    with pytest.raises(TemplateError, match=r"z\.toml:3: unknown key 'mode' in copy\[0\]"):
        TemplateSpec.load(str(p))


@pytest.mark.parametrize(("body", "key"), [
    ('apt = "curl"', "apt"),
    ("run = [1, 2]", "run"),
    ('env = {A = 1}', "env.A"),
    ('workdir = 5', "workdir"),
    ('ready = {port = "80"}', "ready.port"),
    ('copy = ["a"]', "copy"),
])
def test_wrong_type_names_key(tmp_path: Path, body: str, key: str) -> None:
    p = write(tmp_path / "t.toml", f'name = "t"\n{body}\n')
    with pytest.raises(TemplateError, match=f"'{key}' must be"):
        TemplateSpec.load(str(p))


@pytest.mark.parametrize("body", ['name = "Bad Name"', 'variant = "huge"', 'workdir = "rel"',
                                  'user = "1000"', 'ready = {timeout = 3}', 'pip = ["-e ."]'])
def test_bad_values(tmp_path: Path, body: str) -> None:
    with pytest.raises(TemplateError):
        TemplateSpec.load(str(write(tmp_path / "t.toml", body + "\n")))


def test_missing_copy_source(tmp_path: Path) -> None:
    p = write(tmp_path / "t.toml", 'copy = [{src = "nothere.txt", dest = "/x"}]\n')
    with pytest.raises(TemplateError, match=r"nothere\.txt"):
        TemplateSpec.load(str(p))


@pytest.mark.parametrize("src", ["../outside.txt", "/etc/hostname", "sub/../../outside.txt",
                                 "link"])
def test_copy_cannot_escape_spec_dir(tmp_path: Path, src: str) -> None:
    write(tmp_path / "outside.txt", "secret")
    d = tmp_path / "spec"
    (d / "sub").mkdir(parents=True)
    (d / "link").symlink_to(tmp_path / "outside.txt")
    p = write(d / "t.toml", f'copy = [{{src = "{src}", dest = "/x"}}]\n')
    with pytest.raises(TemplateError, match=r"inside|outside"):
        TemplateSpec.load(str(p))


def test_digest_covers_copied_content_and_fields(tmp_path: Path) -> None:
    f = write(tmp_path / "data" / "a.txt", "one")
    p = write(tmp_path / "t.toml", 'copy = [{src = "data", dest = "/data"}]\n')
    d1 = spec_digest(TemplateSpec.load(str(p)))
    assert spec_digest(TemplateSpec.load(str(p))) == d1
    f.write_text("two")
    d2 = spec_digest(TemplateSpec.load(str(p)))
    assert d2 != d1
    write(tmp_path / "data" / "b.txt", "")
    assert spec_digest(TemplateSpec.load(str(p))) not in (d1, d2)
    p.write_text(p.read_text() + 'env = {A = "1"}\n')
    assert spec_digest(TemplateSpec.load(str(p))) not in (d1, d2)


def test_builtins_share_the_base() -> None:
    for name in ("python", "node", "devbox"):
        s = TemplateSpec.load(name)
        assert "python3" in base_apt(s)
        steps = build_steps(s)
        assert steps[0].label == "base step 1" and "useradd" in steps[0].cmd
        assert not any("useradd" in c or "groupadd" in c for c in s.run), name
    assert {"nodejs", "npm"} <= set(TemplateSpec.load("node").apt)


# ---- Dockerfile --------------------------------------------------------------------------
GOOD_DOCKERFILE = """\
# syntax=docker/dockerfile:1
FROM cpuos/python
ENV APP_HOME=/srv/app MODE="fast mode"
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /srv
WORKDIR app
COPY requirements.txt ./
RUN pip install -r requirements.txt \\
    && echo done
COPY src/ lib.py /srv/app/
USER app
RUN ["python3", "-c", "print('hi there')"]
CMD ["python3", "-m", "http.server", "8080"]
"""


def test_dockerfile_good(tmp_path: Path) -> None:
    write(tmp_path / "requirements.txt", "requests\n")
    write(tmp_path / "src" / "m.py", "")
    write(tmp_path / "lib.py", "")
    p = write(tmp_path / "web.Dockerfile", GOOD_DOCKERFILE)
    s = TemplateSpec.load(str(p))
    py = TemplateSpec.load("python")
    assert s.name == "web"
    assert s.apt == py.apt and s.run[:len(py.run)] == py.run
    assert s.run[len(py.run):] == ["pip install -r requirements.txt && echo done",
                                   "python3 -c 'print('\"'\"'hi there'\"'\"')'"]
    assert s.env["APP_HOME"] == "/srv/app" and s.env["MODE"] == "fast mode"
    assert s.env["PATH"].startswith("/opt/venv/bin:/usr/local/sbin:")
    assert (s.workdir, s.user) == ("/srv/app", "app")
    n = len(py.run)
    assert s.copy == [CopySpec("requirements.txt", "/srv/app/", after_run=n),
                      CopySpec("src/", "/srv/app/", after_run=n + 1),
                      CopySpec("lib.py", "/srv/app/", after_run=n + 1)]
    assert s.start == "python3 -m http.server 8080"
    labels = [st.label for st in build_steps(s)]
    assert labels[-5:] == ["copy requirements.txt -> /srv/app/", f"run step {n + 1}",
                           "copy src/ -> /srv/app/", "copy lib.py -> /srv/app/",
                           f"run step {n + 2}"]


def test_dockerfile_named_dockerfile_and_debian_base(tmp_path: Path) -> None:
    p = write(tmp_path / "my_app" / "Dockerfile", "from debian:bookworm-slim\nrun true\n"
              "CMD sleep infinity\n")
    s = TemplateSpec.load(str(p))
    assert (s.name, s.suite, s.run, s.start, s.apt) == ("my-app", "bookworm", ["true"],
                                                        "sleep infinity", [])
    assert TemplateSpec.load(str(p), name="other").name == "other"


@pytest.mark.parametrize(("text", "line", "what"), [
    ("FROM debian:bookworm\nRUN true\nADD x /x\n", 3, "ADD is not supported"),
    ("\n# c\nFROM ubuntu:22.04\n", 3, "unknown base image"),
    ("FROM cpuos/nosuch\n", 1, "unknown base image"),
    ("FROM debian:bookworm AS build\n", 1, "AS"),
    ("FROM debian:bookworm\nFROM debian:bookworm\n", 2, "multi-stage"),
    ("FROM debian:bookworm\nRUN a \\\n  b\nENTRYPOINT [\"x\"]\n", 4, "ENTRYPOINT"),
    ("RUN true\n", 1, "before FROM"),
    ("FROM debian:bookworm\nCOPY --from=a x /x\n", 2, "--from"),
    ("FROM debian:bookworm\nCOPY missing.txt /x\n", 2, "missing.txt"),
    ("FROM debian:bookworm\nCOPY ../up /x\n", 2, "inside"),
])
def test_dockerfile_errors_name_the_line(tmp_path: Path, text: str, line: int,
                                         what: str) -> None:
    p = write(tmp_path / "Dockerfile", text)
    with pytest.raises(TemplateError) as e:
        TemplateSpec.load(str(p))
    assert f"Dockerfile:{line}:" in str(e.value) and what in str(e.value)


# ---- image tarballs ----------------------------------------------------------------------
Entry = tuple[str, str | bytes | None]  # (name, content); "dir/" = directory, "->x" symlink


def layer_tar(entries: list[Entry], gz: bool = False) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for name, data in entries:
            info = tarfile.TarInfo(name.rstrip("/"))
            info.mode = 0o755 if name.endswith("/") else 0o644
            if name.endswith("/"):
                info.type = tarfile.DIRTYPE
                t.addfile(info)
            elif isinstance(data, str) and data.startswith("->"):
                info.type, info.linkname = tarfile.SYMTYPE, data[2:]
                t.addfile(info)
            elif isinstance(data, str) and data.startswith("=>"):
                info.type, info.linkname = tarfile.LNKTYPE, data[2:]
                t.addfile(info)
            else:
                raw = data if isinstance(data, bytes) else (data or "").encode()
                info.size = len(raw)
                t.addfile(info, io.BytesIO(raw))
    out = buf.getvalue()
    return gzip.compress(out) if gz else out


def outer_tar(path: Path, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w") as t:
        for name, raw in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            t.addfile(info, io.BytesIO(raw))
    return path


CONFIG = {"config": {"Env": ["PATH=/usr/bin:/bin", "LANG=C.UTF-8"], "WorkingDir": "/app",
                     "User": "nobody"}}


def docker_save(path: Path, layers: list[bytes]) -> Path:
    files = {f"l{i}/layer.tar": raw for i, raw in enumerate(layers)}
    files["cfg.json"] = json.dumps(CONFIG).encode()
    files["manifest.json"] = json.dumps([{"Config": "cfg.json", "RepoTags": ["x:1"],
                                          "Layers": [f"l{i}/layer.tar"
                                                     for i in range(len(layers))]}]).encode()
    return outer_tar(path, files)


def oci_layout(path: Path, layers: list[bytes]) -> Path:
    blobs: dict[str, bytes] = {}

    def blob(raw: bytes) -> str:
        d = "sha256:" + hashlib.sha256(raw).hexdigest()
        blobs["blobs/sha256/" + d[7:]] = raw
        return d

    manifest = {"schemaVersion": 2, "config": {"digest": blob(json.dumps(CONFIG).encode())},
                "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                            "digest": blob(raw)} for raw in layers]}
    index = {"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json",
         "digest": blob(json.dumps(manifest).encode()),
         "platform": {"architecture": "amd64", "os": "linux"}},
        {"mediaType": "application/vnd.oci.image.manifest.v1+json",
         "digest": blob(b"{}"), "platform": {"architecture": "unknown", "os": "unknown"}}]}
    return outer_tar(path, {"oci-layout": b'{"imageLayoutVersion": "1.0.0"}',
                            "index.json": json.dumps(index).encode(), **blobs})


LOWER: list[Entry] = [("etc/", None), ("etc/keep", "k"), ("etc/gone", "g"), ("opq/", None),
                      ("opq/old", "o"), ("opq/sub/", None), ("opq/sub/deep", "d"),
                      ("usr/", None), ("usr/bin/", None), ("usr/bin/python3", "#!"),
                      ("bin", "->usr/bin"), ("data", "->/srv/data"), ("./srv/", None)]
UPPER: list[Entry] = [("etc/.wh.gone", ""), ("opq/", None), ("opq/.wh..wh..opq", ""),
                      ("opq/new", "n"), ("bin/tool", "t"), ("data/f", "inside"),
                      ("etc/hard", "=>etc/keep"), ("dev/", None)]


def check_tree(root: Path) -> None:
    assert (root / "etc/keep").read_text() == "k"
    assert not (root / "etc/gone").exists()
    assert sorted(os.listdir(root / "opq")) == ["new"]
    assert (root / "usr/bin/tool").read_text() == "t"  # written through bin -> usr/bin
    assert (root / "srv/data/f").read_text() == "inside"  # /srv/data is the image's, not ours
    assert os.readlink(root / "data") == "/srv/data"
    assert (root / "etc/hard").stat().st_ino == (root / "etc/keep").stat().st_ino


@pytest.mark.parametrize("fmt", ["docker", "oci"])
def test_extract_image(tmp_path: Path, fmt: str) -> None:
    make = docker_save if fmt == "docker" else oci_layout
    tar = make(tmp_path / "img.tar", [layer_tar(LOWER), layer_tar(UPPER, gz=fmt == "oci")])
    root = tmp_path / "root"
    root.mkdir()
    lines: list[str] = []
    config = extract_image(tar, root, lines.append)
    assert config["WorkingDir"] == "/app" and "LANG=C.UTF-8" in config["Env"]
    assert any("layer 2/2" in x for x in lines)
    check_tree(root)


@pytest.mark.parametrize(("entries", "what"), [
    ([("ok", "x"), ("../evil", "x")], "escapes the root"),
    ([("/abs", "x")], "escapes the root"),
    ([("a/../../evil", "x")], "escapes the root"),
    ([("h", "=>/etc/passwd")], "hard link"),
    ([("h", "=>../evil")], "hard link"),
    ([("x/.wh...", "")], "whiteout"),
])
def test_malicious_layer_refused(tmp_path: Path, entries: list[Entry], what: str) -> None:
    tar = docker_save(tmp_path / "img.tar", [layer_tar(entries)])
    root = tmp_path / "box" / "root"
    root.mkdir(parents=True)
    with pytest.raises(TemplateError, match=what):
        extract_image(tar, root)
    assert os.listdir(root) == []  # refused before anything was written
    assert not (tmp_path / "box" / "evil").exists() and not (tmp_path / "evil").exists()


def test_symlink_parent_stays_in_root(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    tar = docker_save(tmp_path / "img.tar", [
        layer_tar([("up", "->../../outside"), ("abs", f"->{outside}")]),
        layer_tar([("up/a", "x"), ("abs/b", "y")])])
    root = tmp_path / "root"
    root.mkdir()
    extract_image(tar, root)
    assert os.listdir(outside) == []
    assert (root / "outside/a").read_text() == "x"
    assert (root / str(outside).lstrip("/") / "b").read_text() == "y"
    assert resolve_in_root(root, "up/a") == root / "outside/a"


def test_not_an_image(tmp_path: Path) -> None:
    tar = outer_tar(tmp_path / "x.tar", {"hello": b"hi"})
    with pytest.raises(TemplateError, match="not an image tarball"):
        extract_image(tar, tmp_path)


needs_build_tools = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root")


@needs_build_tools
def test_build_from_oci_records_and_caches(tmp_path: Path) -> None:
    tdir = tmp_path / "templates"
    tar = oci_layout(tmp_path / "img.tar", [layer_tar(LOWER), layer_tar(UPPER)])
    info = build_from_oci(tar, "img", tdir)
    assert not info["cached"] and info["size_bytes"] > 0
    assert (info["workdir"], info["user"]) == ("/app", "nobody")
    assert info["env"] == {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    root = Path(info["rootfs"])
    check_tree(root)
    assert not (root / "etc/ld.so.preload").exists()  # no compat shim any more
    assert template_info(tdir, "img") == info
    again = build_from_oci(tar, "img", tdir)
    assert again["cached"] and again["digest"] == info["digest"]
    assert [i["name"] for i in list_templates(tdir)] == ["img"]
    gone = remove_template(tdir, "img")
    assert {p.name for p in gone} == {"img.json", f"img-{info['digest']}",
                                      f"img-{info['digest']}.log"}
    assert template_info(tdir, "img") is None and not list(tdir.iterdir())


@needs_build_tools
def test_build_from_oci_needs_python3(tmp_path: Path) -> None:
    tar = docker_save(tmp_path / "img.tar", [layer_tar([("etc/", None)])])
    with pytest.raises(TemplateError, match="python3"):
        build_from_oci(tar, "nopy", tmp_path / "t")
    assert not [p for p in (tmp_path / "t").iterdir() if p.is_dir()]  # no half tree left


# ---- CLI ---------------------------------------------------------------------------------
def test_cli_template_build_args(tmp_path: Path) -> None:
    runner = CliRunner()
    assert runner.invoke(cli.app, ["template", "build"]).exit_code == 2
    assert runner.invoke(cli.app, ["template", "build", "--oci", "x.tar"]).exit_code == 2
