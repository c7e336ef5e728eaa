"""``cpuos``: create, drive and kill sandboxes from the shell; run the daemon; build templates.

    ID=$(cpuos create --template python --timeout 15m)
    cpuos exec "$ID" -- python -c 'print(1)'
    cpuos files put "$ID" ./main.py /work/main.py
    cpuos kill "$ID"

Every failure the SDK reports (a ``CpuosError``) becomes one line on stderr,
``error: <code>: <message>``, and exit status 1; usage errors exit 2.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import IO, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperGroup

from .. import __version__
from .._durations import parse_duration, parse_size_mib
from .._errors import CpuosError, InvalidArgument
from .._models import SandboxInfo, TemplateInfo
from .._sync.sandbox import Sandbox
from .._sync.templates import Templates
from . import audit as _audit
from . import shell as _shell
from .._sync.workspace import Workspace
from . import mcp as _mcp
from . import nodes as _nodes
from . import workspaces as _workspaces
from ._options import ApiKey, ApiUrl, JsonOut, SandboxId


class CliError(Exception):
    """A failure found by the CLI itself (bad local file, template build...)."""

    def __init__(self, code: str, message: str, extra: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.extra = extra  # further lines (e.g. a build log tail), printed after the error


def _one_line(s: str) -> str:
    return " ".join(str(s).split())


class _Group(TyperGroup):
    """Turns SDK and CLI errors into one ``error: code: message`` line and exit status 1."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except CpuosError as e:
            _print_error(e.code, e.message)
        except CliError as e:
            _print_error(e.code, e.message)
            if e.extra:
                sys.stderr.write(e.extra.rstrip("\n") + "\n")
        raise typer.Exit(1)


def _print_error(code: str, message: str) -> None:
    sys.stdout.flush()
    sys.stderr.write(f"error: {code}: {_one_line(message)}\n")
    sys.stderr.flush()


app = typer.Typer(
    cls=_Group, name="cpuos", no_args_is_help=True, add_completion=False,
    pretty_exceptions_show_locals=False,  # locals may hold the API key
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Disposable, isolated Linux sandboxes (gVisor) for AI agents.",
)
files_app = typer.Typer(cls=_Group, no_args_is_help=True,
                        help="Read and write files inside a sandbox.")
template_app = typer.Typer(cls=_Group, no_args_is_help=True,
                           help="Build and list sandbox templates (root filesystems).")
port_app = typer.Typer(cls=_Group, no_args_is_help=True,
                       help="Preview URLs for servers inside a sandbox.")
app.add_typer(files_app, name="files")
app.add_typer(template_app, name="template")
app.add_typer(port_app, name="port")



def _out() -> Console:
    # Built per call: CliRunner and redirections swap sys.stdout. Into a pipe or file,
    # tables are never squeezed to 80 columns (that would cut ids and paths).
    c = Console(file=sys.stdout, highlight=False, soft_wrap=False)
    if not c.is_terminal:
        c = Console(file=sys.stdout, highlight=False, soft_wrap=False, width=4096)
    return c


def _err() -> Console:
    return Console(file=sys.stderr, highlight=False)


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def _duration(value: str, what: str) -> str:
    """Check a duration locally (fail before any network call); keep the text for the API."""
    try:
        parse_duration(value, what)
    except ValueError as e:
        raise InvalidArgument(str(e)) from None
    return value


def _idle_duration(value: str) -> str:
    """An idle timeout: a duration, or 0 (never)."""
    return value if value.strip().lower() in ("0", "0s", "never") else _duration(
        value, "idle timeout")


def _pairs(items: list[str] | None, what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items or []:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise typer.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint=what)
        out[k] = v
    return out


def _fmt_dur(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _fmt_time(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.fromtimestamp(ts).astimezone().isoformat(timespec="seconds")


def _fmt_size(n: int) -> str:
    f = float(n)
    for unit in ("B", "K", "M", "G", "T"):
        if f < 1024 or unit == "T":
            return f"{n}" if unit == "B" else f"{f:.1f}{unit}"
        f /= 1024
    return str(n)  # pragma: no cover


_STATE_STYLE = {"running": "green", "creating": "yellow", "killing": "yellow", "error": "red"}


@contextmanager
def _connect(sandbox_id: str, api_url: str | None, api_key: str | None, *,
             resume: bool = False) -> Iterator[Sandbox]:
    """The sandbox; a paused one stays paused unless ``resume`` (exec and files, which
    need it running, say so)."""
    sbx = Sandbox.connect(sandbox_id, auto_resume=resume, api_url=api_url, api_key=api_key)
    try:
        yield sbx
    finally:
        sbx.close()


def _version(value: bool) -> None:
    if value:
        typer.echo(f"cpuos {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Disposable, isolated Linux sandboxes (gVisor) for AI agents."""


# ---- daemon -------------------------------------------------------------------------------
@app.command()
def server(
    host: Annotated[str | None, typer.Option(help="Listen address (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Listen port (default 7770).")] = None,
    home: Annotated[str | None, typer.Option(
        help="State directory (default $CPUOS_HOME or /var/lib/cpuos).")] = None,
) -> None:
    """Run the daemon (cpuosd) in the foreground; needs root."""
    argv = ["cpuosd"]
    for flag, v in (("--host", host), ("--port", port), ("--home", home)):
        if v is not None:
            argv += [flag, str(v)]
    try:  # the daemon's own program (the CLI never imports server code)
        os.execvp(sys.executable, [sys.executable, "-m", "cpuosd", *argv[1:]])
    except OSError as e:
        raise CliError("server", f"cannot start cpuosd: {e}") from None


# ---- lifecycle ----------------------------------------------------------------------------
@app.command()
def create(
    template: Annotated[str, typer.Option("--template", "-t", help="Template name.")] = "python",
    timeout: Annotated[str, typer.Option(
        help="Kill the sandbox this long after creation (e.g. 15m, 1h).")] = "5m",
    env: Annotated[list[str] | None, typer.Option(
        "--env", "-e", metavar="K=V", help="Environment variable for every exec.")] = None,
    metadata: Annotated[list[str] | None, typer.Option(
        "--metadata", "-m", metavar="K=V", help="Metadata label.")] = None,
    cpus: Annotated[int | None, typer.Option("--cpus", "--vcpus", help="Virtual CPUs.")] = None,
    memory: Annotated[str | None, typer.Option(
        "--memory", help="Memory: 1GiB, 512MiB or MiB.")] = None,
    disk: Annotated[str | None, typer.Option(
        "--disk", help="Disk for the sandbox's writes: 5GiB, 512MiB or MiB.")] = None,
    pids: Annotated[int | None, typer.Option(help="Processes and threads at most.")] = None,
    idle_timeout: Annotated[str | None, typer.Option(
        "--idle-timeout", help="Pause it after this long idle (e.g. 5m; 0: never; default: "
        "the workspace's, 10m); any call needing it resumes it.")] = None,
    json_: JsonOut = False,
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Create a sandbox and print its id (only the id: ID=$(cpuos create))."""
    _duration(timeout, "timeout")
    if idle_timeout is not None:
        _idle_duration(idle_timeout)
    env_d, meta_d = _pairs(env, "--env"), _pairs(metadata, "--metadata")
    sbx = Sandbox.create(template=template, timeout=timeout, env=env_d, metadata=meta_d,
                         cpus=cpus, memory=memory, disk=disk, pids=pids,
                         idle_timeout=idle_timeout, api_url=api_url, api_key=api_key)
    try:
        if json_:
            _print_json(dataclasses.asdict(sbx.info()))
        else:
            typer.echo(sbx.id)
    finally:
        sbx.close()


@app.command("ls")
def ls(
    all_: Annotated[bool, typer.Option("--all", "-a", help="Include ended sandboxes.")] = False,
    json_: JsonOut = False,
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """List sandboxes."""
    infos = Sandbox.list(all=all_, api_url=api_url, api_key=api_key)
    if json_:
        _print_json([dataclasses.asdict(i) for i in infos])
        return
    if not infos:
        _err().print("no sandboxes" + ("" if all_ else " running (--all shows ended ones)"),
                     style="dim")
        return
    now = time.time()
    t = Table(box=None, header_style="bold", pad_edge=False)
    for col in ("ID", "TEMPLATE", "STATE", "REASON", "AGE", "LEFT"):
        t.add_column(col, no_wrap=True)
    for i in sorted(infos, key=lambda x: x.created_at or 0):
        t.add_row(i.id, i.template, f"[{_STATE_STYLE.get(i.state, 'dim')}]{i.state}[/]",
                  escape(i.reason or "-"), _fmt_dur(now - i.created_at if i.created_at else None),
                  _fmt_dur(i.timeout_remaining))
    _out().print(t)


def _info_table(i: SandboxInfo) -> Table:
    now = time.time()
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold", no_wrap=True)
    t.add_column()
    rows = [
        ("id", i.id), ("template", i.template),
        ("state", f"[{_STATE_STYLE.get(i.state, 'dim')}]{i.state}[/]"),
        ("reason", escape(i.reason or "-")), ("backend", i.backend),
        ("created", f"{_fmt_time(i.created_at)} ({_fmt_dur(now - i.created_at)} ago)"
         if i.created_at else "-"),
        ("started", _fmt_time(i.started_at)), ("ended", _fmt_time(i.ended_at)),
        ("deadline", _fmt_time(i.deadline)), ("time left", _fmt_dur(i.timeout_remaining)),
        ("idle timeout", (_fmt_dur(i.idle_timeout) if i.idle_timeout else "never")
         if i.idle_timeout is not None else "-"),
        ("vcpus", str(i.vcpus) if i.vcpus is not None else "-"),
        ("memory", f"{i.memory_mib} MiB" if i.memory_mib is not None else "-"),
        ("disk", f"{i.disk_mib} MiB" if i.disk_mib is not None else "-"),
        ("pids", str(i.pids) if i.pids is not None else "-"),
        ("metadata", escape(", ".join(f"{k}={v}" for k, v in sorted((i.metadata or {}).items()))
                            or "-")),
    ]
    if i.node_id:  # (many hosts: the node it runs or is paused on)
        rows.insert(5, ("node", escape(i.node_id)))
    for k, v in rows:  # values are markup: user text in them is escaped
        t.add_row(k, v)
    return t


@app.command()
def info(sandbox_id: SandboxId, json_: JsonOut = False, api_url: ApiUrl = None,
         api_key: ApiKey = None) -> None:
    """Show one sandbox."""
    with _connect(sandbox_id, api_url, api_key) as sbx:
        i = sbx.info()
    if json_:
        _print_json(dataclasses.asdict(i))
    else:
        _out().print(_info_table(i))


@app.command()
def kill(
    sandbox_ids: Annotated[list[str], typer.Argument(metavar="ID", help="Sandbox id(s).")],
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Kill sandboxes (their files are gone for good)."""
    for sid in sandbox_ids:
        with _connect(sid, api_url, api_key) as sbx:
            sbx.kill()


@app.command()
def pause(sandbox_id: SandboxId, api_url: ApiUrl = None, api_key: ApiKey = None) -> None:
    """Pause a sandbox: memory, processes and files to disk; nothing left running."""
    with _connect(sandbox_id, api_url, api_key) as sbx:
        sbx.pause()
    typer.echo(f"{sandbox_id}: paused")


@app.command()
def resume(sandbox_id: SandboxId, api_url: ApiUrl = None, api_key: ApiKey = None) -> None:
    """Resume a paused sandbox as it was."""
    sbx = Sandbox.resume(sandbox_id, api_url=api_url, api_key=api_key)
    sbx.close()
    typer.echo(f"{sandbox_id}: running")


@app.command()
def fork(
    sandbox_id: SandboxId,
    n: Annotated[int, typer.Option("-n", help="How many copies.", min=1, max=16)] = 1,
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Copy a running sandbox (memory, processes, files) N times; prints the new ids."""
    with _connect(sandbox_id, api_url, api_key) as sbx:
        clones = sbx.fork(n=n)
    for c in clones:
        typer.echo(c.id)
        c.close()


@app.command("timeout")
def set_timeout(
    sandbox_id: SandboxId,
    duration: Annotated[str | None, typer.Argument(
        help="New lifetime from now, e.g. 30m.")] = None,
    idle_timeout: Annotated[str | None, typer.Option(
        "--idle-timeout", help="New idle timeout (e.g. 5m; 0: never).")] = None,
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Kill the sandbox DURATION from now (extends or shortens its life); --idle-timeout:
    pause it after that long idle."""
    if duration is None and idle_timeout is None:
        raise InvalidArgument("give a DURATION, --idle-timeout or both")
    if duration is not None:
        _duration(duration, "timeout")
    if idle_timeout is not None:
        _idle_duration(idle_timeout)
    with _connect(sandbox_id, api_url, api_key) as sbx:
        i = sbx.set_idle_timeout(idle_timeout) if idle_timeout is not None else sbx.info()
        if duration is not None:
            i = sbx.set_timeout(duration)
    if duration is not None:
        typer.echo(f"{i.id}: {_fmt_dur(i.timeout_remaining)} left (until "
                   f"{_fmt_time(i.deadline)})")
    if idle_timeout is not None:
        typer.echo(f"{i.id}: paused after "
                   f"{_fmt_dur(i.idle_timeout) if i.idle_timeout else 'never'} idle")


# ---- exec ---------------------------------------------------------------------------------
def _writer(stream: IO[str]) -> Callable[[str], None]:
    """Write each chunk through at once (bytes to the binary layer when there is one)."""
    raw = getattr(stream, "buffer", None)

    def write(text: str) -> None:
        if raw is not None:
            raw.write(text.encode("utf-8", "replace"))
            raw.flush()
        else:
            stream.write(text)
            stream.flush()

    return write


@app.command("exec")
def exec_(
    sandbox_id: SandboxId,
    cmd: Annotated[list[str], typer.Argument(
        metavar="CMD",
        help="One argument: a shell line (bash -c). Several: an argv, run without a shell.")],
    timeout: Annotated[str | None, typer.Option(
        help="Kill the command (and its children) after this long, e.g. 2m; exit 124.")] = None,
    cwd: Annotated[str, typer.Option(help="Working directory.")] = "/work",
    env: Annotated[list[str] | None, typer.Option(
        "--env", "-e", metavar="K=V", help="Environment variable.")] = None,
    stdin: Annotated[bool, typer.Option(
        "--stdin", "-i", help="Send this process's stdin to the command.")] = False,
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Run a command; stream its output; exit with its exit status (124 on timeout)."""
    if timeout is not None:
        _duration(timeout, "timeout")
    env_d = _pairs(env, "--env")
    command: str | list[str] = cmd[0] if len(cmd) == 1 else list(cmd)
    data = sys.stdin.buffer.read() if stdin else None
    sys.stdout.flush()
    sys.stderr.flush()
    with _connect(sandbox_id, api_url, api_key, resume=True) as sbx:
        res = sbx.exec(command, timeout=timeout, cwd=cwd, env=env_d, stdin=data,
                       on_stdout=_writer(sys.stdout), on_stderr=_writer(sys.stderr),
                       max_output=64 * 1024)  # the output is streamed; keep little of it
    if res.timed_out:
        sys.stderr.write(f"cpuos: command timed out after {timeout} and was killed\n"
                         if timeout else "cpuos: command timed out and was killed\n")
        raise typer.Exit(124)
    raise typer.Exit(res.exit_code)


# ---- files --------------------------------------------------------------------------------
@files_app.command("put")
def files_put(
    sandbox_id: SandboxId,
    local: Annotated[Path, typer.Argument(metavar="LOCAL", help="Local file.")],
    remote: Annotated[str, typer.Argument(
        metavar="REMOTE", help="Path in the sandbox (relative: under /work; ending in /: a "
        "directory, the file keeps its name).")],
    recursive: Annotated[bool, typer.Option(
        "--recursive", "-r", help="LOCAL is a directory: copy its tree into the directory "
        "REMOTE (one tar stream).")] = False,
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Upload a local file (or with -r a directory tree) into the sandbox."""
    if recursive:
        if not local.is_dir():
            raise CliError("not_found", f"local directory {str(local)!r} does not exist")
        with _connect(sandbox_id, api_url, api_key, resume=True) as sbx:
            n = sbx.files.upload_dir(local, remote)
        typer.echo(f"{n['path']} ({n['files']} files, {n['dirs']} directories, "
                   f"{n['links']} links, {n['bytes']} bytes)")
        return
    if not local.is_file():
        raise CliError("not_found", f"local file {str(local)!r} does not exist or is not a file")
    if remote.endswith("/"):
        remote += local.name
    with _connect(sandbox_id, api_url, api_key, resume=True) as sbx:
        e = sbx.files.upload(local, remote)
    typer.echo(f"{e.path} ({e.size} bytes)")


@files_app.command("get")
def files_get(
    sandbox_id: SandboxId,
    remote: Annotated[str, typer.Argument(metavar="REMOTE", help="Path in the sandbox.")],
    local: Annotated[str | None, typer.Argument(
        metavar="LOCAL", help="Local file or directory; '-' or omitted: stdout.")] = None,
    recursive: Annotated[bool, typer.Option(
        "--recursive", "-r", help="REMOTE is a directory: copy its tree into the local "
        "directory LOCAL (created).")] = False,
    max_size: Annotated[str | None, typer.Option(
        "--max-size", metavar="SIZE", help="The most to accept, e.g. 20GiB, or 'none' "
        "(default: 1 GiB to stdout, 8 GiB to a file or directory; the daemon's "
        "CPUOS_MAX_READ_BYTES holds anyway).")] = None,
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Download a file (or with -r a directory tree) from the sandbox (a file goes to
    stdout, raw bytes, without LOCAL)."""
    limit: dict[str, Any] = {}
    if max_size is not None:
        try:
            limit["max_bytes"] = None if max_size.strip().lower() == "none" else \
                parse_size_mib(max_size, "--max-size") << 20
        except ValueError as e:
            raise CliError("invalid_argument", str(e)) from None
    if recursive:
        if local is None or local == "-":
            raise CliError("invalid_argument", "get -r needs a LOCAL directory")
        with _connect(sandbox_id, api_url, api_key, resume=True) as sbx:
            sbx.files.download_dir(remote, local, **limit)
        typer.echo(local, err=True)
        return
    with _connect(sandbox_id, api_url, api_key, resume=True) as sbx:
        if local is None or local == "-":
            data = sbx.files.read(remote, **limit)
            sys.stdout.flush()
            raw = getattr(sys.stdout, "buffer", None)
            if raw is not None:
                raw.write(data)
                raw.flush()
            else:  # pragma: no cover - a text-only stdout
                sys.stdout.write(data.decode("utf-8", "replace"))
            return
        dest = Path(local)
        if dest.is_dir():
            dest = dest / Path(remote).name
        # Download beside the target, rename when complete: a failed download leaves nothing.
        tmp = dest.with_name(f".{dest.name}.cpuos-{os.getpid()}.part")
        try:
            sbx.files.download(remote, tmp, **limit)
            os.replace(tmp, dest)
        except OSError as e:
            raise CliError("local_io", f"{dest}: {e.strerror or e}") from None
        finally:
            tmp.unlink(missing_ok=True)
    typer.echo(str(dest), err=True)


@files_app.command("ls")
def files_ls(
    sandbox_id: SandboxId,
    path: Annotated[str, typer.Argument(help="Directory in the sandbox.")] = "/work",
    json_: JsonOut = False,
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """List a directory in the sandbox."""
    with _connect(sandbox_id, api_url, api_key, resume=True) as sbx:
        entries = sbx.files.list(path)
    if json_:
        _print_json([dataclasses.asdict(e) for e in entries])
        return
    t = Table(box=None, header_style="bold", pad_edge=False)
    t.add_column("TYPE", no_wrap=True)
    t.add_column("SIZE", justify="right", no_wrap=True)
    t.add_column("MODE", no_wrap=True)
    t.add_column("NAME", no_wrap=True)
    for e in sorted(entries, key=lambda x: (x.type != "dir", x.name)):
        name = e.name + ("/" if e.type == "dir" else "")
        if e.type == "symlink" and e.target:
            name += f" -> {e.target}"
        t.add_row(e.type, _fmt_size(e.size) if e.type == "file" else "-",
                  f"{e.mode & 0o7777:04o}", escape(name))
    _out().print(t)


@files_app.command("rm")
def files_rm(
    sandbox_id: SandboxId,
    path: Annotated[str, typer.Argument(help="File or directory (removed with its contents).")],
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Remove a file or directory in the sandbox."""
    with _connect(sandbox_id, api_url, api_key, resume=True) as sbx:
        sbx.files.remove(path)


# ---- ports ----------------------------------------------------------------------------------
PortArg = Annotated[int, typer.Argument(help="The port a server listens on inside.")]


@port_app.command("expose")
def port_expose(
    sandbox_id: SandboxId, port: PortArg,
    public: Annotated[bool, typer.Option("--public", help="No token needed.")] = False,
    api_url: ApiUrl = None, api_key: ApiKey = None, json_: JsonOut = False,
) -> None:
    """Expose a port: prints its preview URL (with its token, unless --public)."""
    with _connect(sandbox_id, api_url, api_key) as sbx:
        info = sbx.ports.info(port, public=public or None)
    if json_:
        _print_json(info)
        return
    url = info["url"] if info["public"] else f"{info['url']}?cpuos_token={info['token']}"
    typer.echo(url)


@port_app.command("ls")
def port_ls(sandbox_id: SandboxId, api_url: ApiUrl = None, api_key: ApiKey = None,
            json_: JsonOut = False) -> None:
    """The exposed ports of a sandbox and their URLs."""
    with _connect(sandbox_id, api_url, api_key) as sbx:
        items = sbx.ports.list()
    if json_:
        _print_json(items)
        return
    t = Table(box=None, header_style="bold", pad_edge=False)
    for col in ("PORT", "PUBLIC", "URL"):
        t.add_column(col, no_wrap=True)
    for i in items:
        t.add_row(str(i["port"]), "yes" if i["public"] else "no", str(i["url"]))
    _out().print(t)


@port_app.command("rm")
def port_rm(sandbox_id: SandboxId, port: PortArg, api_url: ApiUrl = None,
            api_key: ApiKey = None) -> None:
    """Unexpose a port: its URLs stop working."""
    with _connect(sandbox_id, api_url, api_key) as sbx:
        sbx.ports.unexpose(port)


# ---- templates ----------------------------------------------------------------------------
@template_app.command("build")
def template_build(
    source: Annotated[str | None, typer.Argument(
        metavar="NAME_OR_FILE",
        help="A built-in template (python, node, devbox), a TOML spec, or a Dockerfile "
             "(named Dockerfile or *.Dockerfile); a file's directory is uploaded as the "
             "build context.")] = None,
    oci: Annotated[Path | None, typer.Option(
        "--oci", metavar="TARBALL",
        help="Build from an image tarball (docker save, or an OCI layout) instead.")] = None,
    name: Annotated[str | None, typer.Option(
        "--name", help="The template's name (needed with --oci; overrides a spec's).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Rebuild even if cached.")] = False,
    api_url: ApiUrl = None, api_key: ApiKey = None, json_: JsonOut = False,
) -> None:
    """Build a template on the daemon's host (admin key); the build log streams here."""
    if (source is None) == (oci is None):
        raise typer.BadParameter("give NAME_OR_FILE or --oci TARBALL (one of them)")
    if oci is not None and not name:
        raise typer.BadParameter("--oci needs --name")
    label = name or (Path(source).name if source else "template")
    with Templates(api_url=api_url, api_key=api_key) as t:
        if oci is not None:
            assert name is not None
            info = _with_progress(label, lambda on_line: t.build_oci(
                oci, name=name, force=force, on_log=on_line))
        else:
            assert source is not None
            info = _with_progress(label, lambda on_line: t.build(
                source, name=name, force=force, on_log=on_line))
    if json_:
        _print_json(dataclasses.asdict(info))
        return
    g = Table.grid(padding=(0, 2))
    g.add_column(style="bold", no_wrap=True)
    g.add_column()
    g.add_row("name", info.name)
    g.add_row("digest", info.digest)
    g.add_row("rootfs", str(info.rootfs))
    g.add_row("size", _fmt_size(int(info.size_bytes or 0)))
    if info.cached:
        g.add_row("build", "cached (use --force to rebuild)")
    else:
        g.add_row("build", f"{info.build_seconds if info.build_seconds is not None else '?'}s")
    _out().print(g)


def _with_progress(name: str, run: Callable[[Callable[[str], None]], TemplateInfo]
                   ) -> TemplateInfo:
    """``run(on_line)`` with its output as a spinner line on a terminal, else on stderr."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    err = _err()
    if not err.is_terminal:
        def on_line(line: str) -> None:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()

        return run(on_line)
    with Progress(SpinnerColumn(), TextColumn(f"building [bold]{escape(name)}[/]"),
                  TimeElapsedColumn(), TextColumn("{task.description}", markup=False),
                  console=err, transient=True) as progress:
        task = progress.add_task("starting", total=None)
        width = max(20, err.width - len(name) - 30)

        def show(line: str) -> None:
            line = line.strip()
            if line:
                progress.update(task, description=line[:width])

        return run(show)


@template_app.command("ls")
def template_ls(api_url: ApiUrl = None, api_key: ApiKey = None, json_: JsonOut = False) -> None:
    """List the templates built on the daemon's host: name, digest, size, built time."""
    with Templates(api_url=api_url, api_key=api_key) as t:
        items = t.list()
    if json_:
        _print_json([dataclasses.asdict(i) for i in items])
        return
    if not items:
        _err().print("no templates built (cpuos template build python)", style="dim",
                     markup=False)
        return
    tab = Table(box=None, header_style="bold", pad_edge=False)
    for col in ("NAME", "DIGEST", "SIZE", "BUILT"):
        tab.add_column(col, no_wrap=True)
    for i in items:
        tab.add_row(i.name, i.digest, _fmt_size(int(i.size_bytes or 0)),
                    _fmt_time(i.built_at) if i.built_at else "-")
    _out().print(tab)


@template_app.command("rm")
def template_rm(
    name: Annotated[str, typer.Argument(help="The template to delete.")],
    force: Annotated[bool, typer.Option(
        "--force", help="Delete even while sandboxes of it are alive (they may break).")
    ] = False,
    api_url: ApiUrl = None, api_key: ApiKey = None,
) -> None:
    """Delete a template's builds and snapshot images (admin key)."""
    with Templates(api_url=api_url, api_key=api_key) as t:
        d = t.remove(name, force=force)
    _err().print(f"removed template {name} ({d.get('paths')} path(s), "
                 f"{d.get('snapshot_images')} snapshot image(s))", style="dim", markup=False)


_audit.register(app)
_mcp.register(app)
_shell.register(app)
_workspaces.register(app, _Group)
_nodes.register(app, _Group)


# ---- usage and live metrics ---------------------------------------------------------------
@app.command("usage")
def usage_cmd(
    since: Annotated[str | None, typer.Option(
        help="From (epoch seconds or ISO 8601; default: the start of this month, UTC).")] = None,
    until: Annotated[str | None, typer.Option(help="To (default: now).")] = None,
    sandbox: Annotated[str | None, typer.Option("--sandbox", "-s", help="One sandbox.")] = None,
    json_: JsonOut = False, api_url: ApiUrl = None, api_key: ApiKey = None,
) -> None:
    """What this workspace's sandboxes used (per second) and cost."""
    with Workspace(api_url=api_url, api_key=api_key) as ws:
        u = ws.usage(since=since, until=until, sandbox=sandbox)
    if json_:
        _print_json(u)
        return
    tab = Table(box=None, header_style="bold", pad_edge=False)
    for col in ("SANDBOX", "RUNNING", "VCPU-S", "GIB-S", "PAUSED", "SNAP GIB-S", "COST $"):
        tab.add_column(col, no_wrap=True, justify="left" if col == "SANDBOX" else "right")
    for r in [*u["sandboxes"], {"id": "total", **u["total"]}]:
        tab.add_row(r["id"], _fmt_dur(r["running_seconds"]), f"{r['vcpu_seconds']:.0f}",
                    f"{r['memory_gib_seconds']:.0f}", _fmt_dur(r["paused_seconds"]),
                    f"{r['snapshot_gib_seconds']:.1f}", f"{r['cost']:.4f}")
    _out().print(tab)
    cap = u["spending_cap"]
    _err().print(f"{_fmt_time(u['since'])} .. {_fmt_time(u['until'])}; this month "
                 f"${cap['month_spent']:.4f}" + (f" of a ${cap['cap']:.2f} cap"
                                                 + (" (reached)" if cap["reached"] else "")
                                                 if cap["cap"] is not None else ""),
                 style="dim", markup=False)


def _top_table(rows: list[dict[str, Any]], before: dict[str, dict[str, Any]]) -> Table:
    tab = Table(box=None, header_style="bold", pad_edge=False)
    for col in ("ID", "STATE", "CPU%", "MEM", "MEM LIMIT", "DISK", "PIDS", "NET RX/TX"):
        tab.add_column(col, no_wrap=True, justify="left" if col in ("ID", "STATE") else "right")
    for m in rows:
        prev = before.get(m["id"])
        cpu = "-"
        if prev and "cpu_seconds" in m and "cpu_seconds" in prev and m["time"] > prev["time"]:
            used = m["cpu_seconds"] - prev["cpu_seconds"]
            cpu = f"{100 * used / (m['time'] - prev['time']):.0f}"
        elif "cpu_percent_avg" in m:
            cpu = f"{m['cpu_percent_avg']:.0f}~"
        mem = _fmt_size(int(m["memory_bytes"])) if "memory_bytes" in m else "-"
        disk = (f"{_fmt_size(int(m['disk_used_bytes']))}/{_fmt_size(int(m['disk_limit_bytes']))}"
                if "disk_used_bytes" in m else "-")
        net = (f"{_fmt_size(int(m['net_rx_bytes']))}/{_fmt_size(int(m['net_tx_bytes']))}"
               if "net_rx_bytes" in m else "-")
        pids = f"{m['pids']}/{m.get('pids_limit') or '-'}" if "pids" in m else "-"
        tab.add_row(m["id"], f"[{_STATE_STYLE.get(m['state'], 'dim')}]{m['state']}[/]", cpu,
                    mem, _fmt_size(int(m["memory_limit_bytes"])), disk, pids, net)
    return tab


@app.command("top")
def top(
    interval: Annotated[float, typer.Option(help="Seconds between refreshes.")] = 2.0,
    once: Annotated[bool, typer.Option("--once", help="Print one table and exit.")] = False,
    json_: JsonOut = False, api_url: ApiUrl = None, api_key: ApiKey = None,
) -> None:
    """Every running (and paused) sandbox, live: CPU %, memory, disk, tasks, network."""
    from rich.live import Live

    if interval < 0.2:
        raise InvalidArgument("--interval must be at least 0.2 s")
    with Workspace(api_url=api_url, api_key=api_key) as ws:
        rows = ws.metrics()
        if json_:
            _print_json(rows)
            return
        if once:
            _out().print(_top_table(rows, {}))
            return
        before = {m["id"]: m for m in rows}
        with Live(_top_table(rows, {}), console=_out(), auto_refresh=False) as live:
            try:
                while True:
                    time.sleep(interval)
                    rows = ws.metrics()
                    live.update(_top_table(rows, before), refresh=True)
                    before = {m["id"]: m for m in rows}
            except KeyboardInterrupt:
                pass


def main() -> None:
    app()


if __name__ == "__main__":
    main()
