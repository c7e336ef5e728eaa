"""Template specs: the TOML format, a Dockerfile subset, and their validation.

TOML keys (all optional but ``name``, which defaults to the file's stem)::

    name = "web"                 # ^[a-z0-9][a-z0-9-]{0,63}$
    suite = "bookworm"           # Debian suite for mmdebstrap
    variant = "minbase"          # mmdebstrap variant
    apt = ["nodejs"]             # Debian packages
    pip = ["requests==2.31"]     # pip install --break-system-packages, after apt
    npm = ["typescript"]         # npm install -g, after pip
    copy = [{src = "app", dest = "/work/app"}]   # src relative to this file's directory
    env = {NODE_ENV = "production"}
    workdir = "/work"            # the sandbox's working directory (created, owned by uid 1000)
    user = "user"                # the sandbox's user (uid 1000; "root" for none)
    run = ["make -C /work/app"]  # build steps, as root, in `workdir`, after the copies
    start = "node /work/app/server.js"        # started in the sandbox before its snapshot
    ready = {port = 8080, timeout = 30}       # or {cmd = "curl -sf localhost:8080"}

Every template also gets the builder's base (python3 for the guest agent, user 1000, the
work directory): see ``builder.base_steps``.

Dockerfile subset (``TemplateSpec.from_dockerfile``): ``FROM debian:bookworm[-slim]`` or
``FROM cpuos/<builtin>``, ``RUN``, ``COPY src... dest``, ``ENV``, ``WORKDIR``, ``USER`` and
``CMD`` (-> ``start``). RUN and COPY keep their order. Unlike Docker, every RUN step runs
as root in the final WORKDIR with the final ENV, and a template's defaults (user ``user``,
workdir ``/work``) apply where the Dockerfile sets none.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
import tomllib
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import Any

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")
PKG_RE = re.compile(r"^[a-z0-9][a-z0-9+.-]*$")
SUITE_RE = re.compile(r"^[a-z][a-z0-9-]*$")
USER_RE = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
VARIANTS = {"extract", "custom", "essential", "apt", "required", "minbase", "buildd",
            "important", "debootstrap", "standard"}
BUILTIN_DIR = Path(__file__).parent / "builtin"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DOCKER_BASES = {"debian:bookworm": "bookworm", "debian:bookworm-slim": "bookworm"}
DOCKER_INSTRUCTIONS = ("FROM", "RUN", "COPY", "ENV", "WORKDIR", "USER", "CMD")


class TemplateError(Exception):
    pass


@dataclass(frozen=True)
class CopySpec:
    src: str  # relative to the spec file's directory; a file or a directory
    dest: str  # absolute in the root; a directory (existing, or ending in "/") gets src inside
    after_run: int = 0  # applied after this many `run` steps (Dockerfile order; TOML: 0)


@dataclass(frozen=True)
class Ready:
    cmd: str | None = None
    port: int | None = None
    timeout: float = 60.0


@dataclass
class TemplateSpec:
    name: str
    suite: str = "bookworm"
    variant: str = "minbase"
    apt: list[str] = field(default_factory=list)
    pip: list[str] = field(default_factory=list)
    npm: list[str] = field(default_factory=list)
    copy: list[CopySpec] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/work"
    user: str = "user"
    run: list[str] = field(default_factory=list)
    start: str | None = None
    ready: Ready | None = None
    # Where COPY sources are looked up (the spec file's directory); not part of the digest.
    base_dir: Path | None = None

    @classmethod
    def load(cls, name_or_path: str, *, name: str | None = None) -> TemplateSpec:
        """A built-in name (``python``), a TOML file, or a Dockerfile (named ``Dockerfile``
        or ``*.Dockerfile``). ``name`` overrides the template's name."""
        p = Path(name_or_path)
        if p.name == "Dockerfile" or p.name.endswith(".Dockerfile"):
            return cls.from_dockerfile(p, name=name)
        if not p.suffix and "/" not in name_or_path:
            p = BUILTIN_DIR / f"{name_or_path}.toml"
            if not p.exists():
                known = ", ".join(sorted(x.stem for x in BUILTIN_DIR.glob("*.toml")))
                raise TemplateError(f"no built-in template {name_or_path!r} (known: {known})")
        spec = _TomlReader(p).spec()
        if name:
            spec.name = name
        spec.validate(str(p))
        return spec

    @classmethod
    def from_dockerfile(cls, path: str | Path, *, name: str | None = None) -> TemplateSpec:
        p = Path(path)
        spec = _DockerfileReader(p, name or _name_from_path(p)).spec()
        spec.validate(str(p))
        return spec

    def validate(self, where: str = "spec") -> None:
        """Check the values (the parsers have checked the types); raises TemplateError."""
        def bad(msg: str) -> TemplateError:
            return TemplateError(f"{where}: {msg}")

        if not NAME_RE.fullmatch(self.name):
            raise bad(f"bad template name {self.name!r} (want ^[a-z0-9][a-z0-9-]{{0,63}}$)")
        if not SUITE_RE.fullmatch(self.suite):
            raise bad(f"bad suite {self.suite!r}")
        if self.variant not in VARIANTS:
            raise bad(f"bad variant {self.variant!r} (known: {', '.join(sorted(VARIANTS))})")
        badpkgs = [x for x in self.apt if not PKG_RE.fullmatch(x)]
        if badpkgs:
            raise bad(f"bad package name(s) {badpkgs}")
        for key, pkgs in (("pip", self.pip), ("npm", self.npm)):
            odd = [x for x in pkgs if not x.strip() or x.startswith("-")]
            if odd:
                raise bad(f"bad {key} package(s) {odd} (options are not allowed)")
        odd = [k for k in self.env if not ENV_KEY_RE.fullmatch(k)]
        if odd:
            raise bad(f"bad env variable name(s) {odd}")
        for key, path in [("workdir", self.workdir)] + [("copy dest", c.dest) for c in self.copy]:
            if not _clean_abs(path):
                raise bad(f"{key} {path!r} must be an absolute path without '..'")
        if self.user != "root" and not USER_RE.fullmatch(self.user):
            raise bad(f"bad user {self.user!r} (a user name, e.g. 'user' or 'root')")
        if any(not c.strip() for c in self.run) or (self.start is not None
                                                     and not self.start.strip()):
            raise bad("empty command in run/start")
        r = self.ready
        if r is not None:
            if (r.cmd is None) == (r.port is None):
                raise bad("ready needs exactly one of cmd or port")
            if r.port is not None and not 0 < r.port < 65536:
                raise bad(f"ready.port {r.port} out of range")
            if r.timeout <= 0:
                raise bad("ready.timeout must be > 0")
        self.copy_sources()

    def copy_sources(self) -> list[Path]:
        """The host paths of the COPY sources, in ``copy`` order. Each must exist and stay
        inside the spec's directory (no absolute path, no '..', no symlink leading out)."""
        return [copy_source(self.base_dir or Path.cwd(), c.src) for c in self.copy]

    def fields(self) -> dict[str, Any]:
        """Everything that defines the template (for the digest), without ``base_dir``."""
        d = asdict(self)
        del d["base_dir"]
        return d


def copy_source(base_dir: Path, src: str) -> Path:
    base = base_dir.resolve()
    parts = PurePosixPath(src).parts
    if src.startswith("/") or ".." in parts or not src:
        raise TemplateError(f"copy source {src!r} must be a relative path inside {base}")
    p = base / src
    if not p.exists():
        raise TemplateError(f"copy source {src!r} not found in {base}")
    real = p.resolve()
    if not real.is_relative_to(base):
        raise TemplateError(f"copy source {src!r} leads outside {base} (to {real})")
    return real


def _clean_abs(path: str) -> bool:
    return path.startswith("/") and ".." not in PurePosixPath(path).parts and "\0" not in path


def _name_from_path(p: Path) -> str:
    stem = p.name.removesuffix(".Dockerfile") if p.name != "Dockerfile" else p.resolve().parent.name
    return re.sub(r"[^a-z0-9-]+", "-", stem.lower()).strip("-")[:64] or "template"


# ---- TOML ----------------------------------------------------------------------------------
class _TomlReader:
    KEYS = ("name", "suite", "variant", "apt", "pip", "npm", "copy", "env", "workdir", "user",
            "run", "start", "ready")

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.text = path.read_text()
            self.data = tomllib.loads(self.text)
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            raise TemplateError(f"{path}: {e}") from None

    def spec(self) -> TemplateSpec:
        d = self.data
        self._no_unknown(d, self.KEYS, "")
        kw: dict[str, Any] = {"name": self._str(d, "name") if "name" in d else self.path.stem,
                              "base_dir": self.path.resolve().parent}
        for key in ("suite", "variant", "workdir", "user", "start"):
            if key in d:
                kw[key] = self._str(d, key)
        for key in ("apt", "pip", "npm", "run"):
            if key in d:
                kw[key] = self._strs(d, key)
        if "env" in d:
            env = self._table(d, "env")
            kw["env"] = {k: self._str(env, k, f"env.{k}") for k in env}
        if "copy" in d:
            items = d["copy"]
            if not isinstance(items, list) or not all(isinstance(x, dict) for x in items):
                raise self._type("copy", "a list of tables {src = ..., dest = ...}")
            kw["copy"] = [self._copy(i, x) for i, x in enumerate(items)]
        if "ready" in d:
            kw["ready"] = self._ready(self._table(d, "ready"))
        return TemplateSpec(**kw)

    def _copy(self, i: int, x: dict[str, Any]) -> CopySpec:
        self._no_unknown(x, ("src", "dest"), f"copy[{i}]")
        for key in ("src", "dest"):
            if key not in x:
                raise TemplateError(f"{self.path}: copy[{i}] needs {key!r}")
        return CopySpec(self._str(x, "src", f"copy[{i}].src"),
                        self._str(x, "dest", f"copy[{i}].dest"))

    def _ready(self, r: dict[str, Any]) -> Ready:
        self._no_unknown(r, ("cmd", "port", "timeout"), "ready")
        port, timeout = r.get("port"), r.get("timeout", 60.0)
        if port is not None and (not isinstance(port, int) or isinstance(port, bool)):
            raise self._type("ready.port", "an integer")
        if not isinstance(timeout, int | float) or isinstance(timeout, bool):
            raise self._type("ready.timeout", "a number of seconds")
        cmd = self._str(r, "cmd", "ready.cmd") if "cmd" in r else None
        return Ready(cmd=cmd, port=port, timeout=float(timeout))

    def _no_unknown(self, table: dict[str, Any], known: tuple[str, ...], where: str) -> None:
        for key in table:
            if key not in known:
                at = f" in {where}" if where else ""
                raise TemplateError(f"{self.path}:{self._line_of(key)}: unknown key {key!r}{at} "
                                    f"(known: {', '.join(known)})")

    def _line_of(self, key: str) -> int | str:
        """The line a key is written on, found by scanning the text: a `key =` (also dotted
        or inline), or a `[key]` table header. '?' when not found."""
        k = rf"""(?:{re.escape(key)}|"{re.escape(key)}"|'{re.escape(key)}')"""
        patterns = (rf"^\s*{k}\s*[=.]", rf"^\s*\[\[?\s*{k}\s*[\].]", rf"[{{,.]\s*{k}\s*=")
        for pat in patterns:
            for n, line in enumerate(self.text.splitlines(), 1):
                if re.search(pat, line):
                    return n
        return "?"

    def _type(self, key: str, want: str) -> TemplateError:
        return TemplateError(f"{self.path}:{self._line_of(key.rpartition('.')[2])}: "
                             f"{key!r} must be {want}")

    def _str(self, table: dict[str, Any], key: str, label: str | None = None) -> str:
        v = table[key]
        if not isinstance(v, str):
            raise self._type(label or key, f"a string, not {type(v).__name__}")
        return v

    def _strs(self, table: dict[str, Any], key: str) -> list[str]:
        v = table[key]
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise self._type(key, "a list of strings")
        return list(v)

    def _table(self, table: dict[str, Any], key: str) -> dict[str, Any]:
        v = table[key]
        if not isinstance(v, dict):
            raise self._type(key, "a table")
        return v


# ---- Dockerfile ----------------------------------------------------------------------------
class _DockerfileReader:
    def __init__(self, path: Path, name: str) -> None:
        self.path = path
        self.name = name
        try:
            self.text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise TemplateError(f"{path}: {e}") from None
        self.base_dir = path.resolve().parent
        self.line = 0

    def error(self, msg: str) -> TemplateError:
        return TemplateError(f"{self.path}:{self.line}: {msg}")

    def spec(self) -> TemplateSpec:
        spec: TemplateSpec | None = None
        for lineno, instr in _logical_lines(self.text):
            self.line = lineno
            word, _, rest = instr.partition(" ")
            word, rest = word.upper(), rest.strip()
            if word not in DOCKER_INSTRUCTIONS:
                raise self.error(f"{word} is not supported (supported: "
                                 f"{', '.join(DOCKER_INSTRUCTIONS)})")
            if word == "FROM":
                if spec is not None:
                    raise self.error("multi-stage builds (a second FROM) are not supported")
                spec = self._from(rest)
            elif spec is None:
                raise self.error(f"{word} before FROM")
            elif not rest:
                raise self.error(f"{word} needs an argument")
            else:
                self._apply(spec, word, rest)
        if spec is None:
            raise TemplateError(f"{self.path}: no FROM instruction")
        return spec

    def _from(self, rest: str) -> TemplateSpec:
        args = rest.split()
        if len(args) != 1 or args[0].startswith("--"):
            raise self.error(f"FROM {rest!r}: only `FROM <image>` is supported "
                             "(no --platform, no `AS` stages)")
        image = args[0]
        if image in DOCKER_BASES:
            return TemplateSpec(name=self.name, suite=DOCKER_BASES[image], base_dir=self.base_dir)
        builtin = image.removeprefix("cpuos/")
        if image.startswith("cpuos/") and NAME_RE.fullmatch(builtin) \
                and (BUILTIN_DIR / f"{builtin}.toml").is_file():
            base = TemplateSpec.load(builtin)
            return replace(base, name=self.name, copy=[], base_dir=self.base_dir)
        known = [*DOCKER_BASES, *(f"cpuos/{x.stem}" for x in sorted(BUILTIN_DIR.glob("*.toml")))]
        raise self.error(f"unknown base image {image!r} (known: {', '.join(known)})")

    def _apply(self, spec: TemplateSpec, word: str, rest: str) -> None:
        if word == "RUN":
            spec.run.append(_command(rest))
        elif word == "CMD":
            spec.start = _command(rest)
        elif word == "ENV":
            for k, v in self._env_pairs(rest):
                if not ENV_KEY_RE.fullmatch(k):
                    raise self.error(f"bad ENV name {k!r}")
                spec.env[k] = _expand(v, {"PATH": DEFAULT_PATH, **spec.env})
        elif word == "WORKDIR":
            spec.workdir = self._abs(spec, _expand(rest, spec.env))
        elif word == "USER":
            spec.user = rest.split(":")[0]
            if spec.user != "root" and not USER_RE.fullmatch(spec.user):
                raise self.error(f"USER {rest!r}: want a user name (the template creates it "
                                 "with uid 1000)")
        else:
            self._copy(spec, rest)

    def _copy(self, spec: TemplateSpec, rest: str) -> None:
        args = _json_list(rest) or rest.split()
        if any(a.startswith("--") for a in args):
            raise self.error("COPY options (--from, --chown, ...) are not supported")
        if len(args) < 2:
            raise self.error("COPY needs a source and a destination")
        *srcs, dest = (_expand(a, spec.env) for a in args)
        if len(srcs) > 1 and not dest.endswith("/"):
            raise self.error("COPY with several sources needs a destination ending in '/'")
        into = dest.endswith("/")
        dest = self._abs(spec, dest)
        dest += "/" if into and dest != "/" else ""
        for src in srcs:
            if any(c in src for c in "*?["):
                raise self.error(f"COPY wildcards are not supported ({src!r})")
            try:
                copy_source(self.base_dir, src)
            except TemplateError as e:
                raise self.error(str(e)) from None
            spec.copy.append(CopySpec(src, dest, after_run=len(spec.run)))

    def _abs(self, spec: TemplateSpec, path: str) -> str:
        out = posixpath.normpath(posixpath.join(spec.workdir, path))
        if not _clean_abs(out) or ".." in PurePosixPath(path).parts:
            raise self.error(f"bad path {path!r}")
        return out

    def _env_pairs(self, rest: str) -> list[tuple[str, str]]:
        first = rest.split(None, 1)
        if "=" not in first[0]:  # legacy `ENV key value with spaces`
            if len(first) != 2:
                raise self.error("ENV needs key=value (or `ENV key value`)")
            return [(first[0], first[1])]
        try:
            words = shlex.split(rest)
        except ValueError as e:
            raise self.error(f"ENV: {e}") from None
        if not all("=" in w for w in words):
            raise self.error("ENV: mixed `key=value` and bare words")
        return [(k, v) for k, _, v in (w.partition("=") for w in words)]


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, instruction): comments and blank lines dropped, backslash
    continuations joined."""
    out: list[tuple[int, str]] = []
    buf: list[str] = []
    start = 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # also inside a continuation, as Docker does
        if not buf:
            start = n
        if line.endswith("\\"):
            buf.append(line[:-1].rstrip())
            continue
        buf.append(line)
        out.append((start, " ".join(buf)))
        buf = []
    if buf:
        out.append((start, " ".join(buf)))
    return out


def _json_list(s: str) -> list[str] | None:
    if not s.startswith("["):
        return None
    try:
        v = json.loads(s)
    except ValueError:
        return None
    return v if isinstance(v, list) and v and all(isinstance(x, str) for x in v) else None


def _command(rest: str) -> str:
    """Exec form (a JSON array) becomes a shell-quoted command; shell form stays as is."""
    argv = _json_list(rest)
    return shlex.join(argv) if argv else rest


def _expand(s: str, env: dict[str, str]) -> str:
    """``$VAR`` and ``${VAR}`` from the variables set so far (unknown ones are empty)."""
    return re.sub(r"\$(?:\{(\w+)\}|(\w+))",
                  lambda m: env.get(m.group(1) or m.group(2), ""), s)
