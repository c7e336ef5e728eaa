"""``cpuos shell ID``: the caller's terminal attached to a new terminal inside the sandbox
(raw mode, resized on SIGWINCH, exits with the shell's status); Ctrl-] detaches (the shell
goes on) and ``cpuos shell ID --attach PID`` attaches again, as with tmux."""

from __future__ import annotations

import os
import select
import signal
import sys
import termios
import tty
from types import FrameType
from typing import Annotated

import typer

from .._errors import CpuosError
from .._sync.sandbox import Sandbox
from ._options import ApiKey, ApiUrl


DETACH = b"\x1d"  # Ctrl-]
REPLAY = 64 << 10  # bytes of a terminal's recent output shown on attach


def shell(
    sandbox_id: Annotated[str, typer.Argument(metavar="ID", help="Sandbox id.")],
    attach: Annotated[int | None, typer.Option(
        "--attach", metavar="PID", help="Attach to a terminal left running (detached).")
    ] = None,
    cmd: Annotated[str | None, typer.Option(
        "--cmd", "-c", help="Run this instead of a login bash.")] = None,
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """A terminal inside the sandbox; exits with its shell's status. Ctrl-] detaches."""
    if not os.isatty(0):
        typer.echo("cpuos shell: standard input is not a terminal", err=True)
        raise typer.Exit(2)
    try:
        code = _run(sandbox_id, attach, cmd, api_url, api_key)
    except CpuosError as e:
        typer.echo(f"cpuos: {e.message}", err=True)
        raise typer.Exit(1) from None
    raise typer.Exit(code)


def _size() -> tuple[int, int]:
    """The caller's terminal's size (of the tty itself: COLUMNS/LINES may be stale)."""
    try:
        sz = os.get_terminal_size(0)
        return sz.columns, sz.lines
    except OSError:
        return 80, 24


def _write_out(data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(1, view):]


def _run(sandbox_id: str, attach: int | None, cmd: str | None, api_url: str | None,
         api_key: str | None) -> int:
    cols, rows = _size()
    sbx = Sandbox.connect(sandbox_id, api_url=api_url, api_key=api_key)
    try:
        if attach is None:
            term = sbx.pty.create(cols, rows, on_data=_write_out, cmd=cmd, max_output=4096)
        else:
            info = sbx.commands.connect(attach).info()
            term = sbx.pty.connect(attach, on_data=_write_out, max_output=4096,
                                   offset=max(info.out_start, info.out_end - REPLAY))
            term.resize(cols, rows)
        resized = [False]

        def on_winch(_sig: int, _frame: FrameType | None) -> None:
            resized[0] = True

        old_winch = signal.signal(signal.SIGWINCH, on_winch)
        saved = termios.tcgetattr(0)
        detached = False
        try:
            tty.setraw(0, termios.TCSANOW)  # keys typed ahead are kept
            while not term._reader.done():
                if resized[0]:
                    resized[0] = False
                    term.resize(*_size())
                try:
                    ready, _, _ = select.select([0], [], [], 0.1)
                except InterruptedError:
                    continue
                if not ready:
                    continue
                data = os.read(0, 65536)
                if not data:
                    break
                if DETACH in data:
                    before = data.split(DETACH, 1)[0]
                    if before:
                        term.send_input(before)
                    detached = True
                    break
                term.send_input(data)
        finally:
            termios.tcsetattr(0, termios.TCSADRAIN, saved)
            signal.signal(signal.SIGWINCH, old_winch)
        if detached or not term._reader.done():
            term.disconnect()
            sys.stderr.write(f"\r\n[detached; attach again: cpuos shell {sandbox_id} "
                             f"--attach {term.pid}]\r\n")
            return 0
        return term.wait().exit_code
    finally:
        sbx.close()


def register(app: typer.Typer) -> None:
    app.command("shell")(shell)
