"""The ``cpuos`` CLI without a daemon: help, error lines, exit codes, argument handling
(the SDK is replaced by a fake where a command would need a sandbox)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
from typer.testing import CliRunner

from cpuos import ExecResult, FileEntry, NotFound
from cpuos.cli import main as cli

runner = CliRunner()
DEAD = ["--api-url", "http://127.0.0.1:9", "--api-key", "x"]  # nothing listens on port 9


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for k in ("CPUOS_API_URL", "CPUOS_API_KEY"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("CPUOS_HOME", str(tmp_path / "home"))  # no readable admin.key
    monkeypatch.setenv("CPUOS_TEMPLATES_DIR", str(tmp_path / "templates"))


def run(*args: str, input: str | bytes | None = None) -> Any:
    return runner.invoke(cli.app, list(args), input=input)


def one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: "), stderr
    assert "Traceback" not in stderr
    return lines[0]


def test_help_lists_commands() -> None:
    r = run("--help")
    assert r.exit_code == 0
    for name in ("server", "create", "ls", "info", "exec", "files", "kill", "timeout",
                 "template"):
        assert name in r.stdout
    r = run("files", "--help")
    assert r.exit_code == 0
    for name in ("put", "get", "ls", "rm"):
        assert name in r.stdout
    r = run("template", "--help")
    assert r.exit_code == 0 and "build" in r.stdout


def test_version() -> None:
    r = run("--version")
    assert r.exit_code == 0 and r.stdout.startswith("cpuos ")


def test_unreachable_daemon_is_one_line() -> None:
    r = run("info", "sbx-nope", *DEAD)
    assert r.exit_code == 1
    line = one_error_line(r.stderr)
    assert line.startswith("error: unavailable: ")
    assert r.stdout == ""


@pytest.mark.parametrize("args", [["ls"], ["create"], ["kill", "sbx-a"],
                                  ["files", "ls", "sbx-a"], ["timeout", "sbx-a", "5m"]])
def test_every_client_command_reports_unavailable(args: list[str]) -> None:
    r = run(*args, *DEAD)
    assert r.exit_code == 1
    assert one_error_line(r.stderr).startswith("error: unavailable: ")


def test_api_url_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CPUOS_API_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("CPUOS_API_KEY", "x")
    r = run("ls")
    assert r.exit_code == 1
    assert "127.0.0.1:9" in one_error_line(r.stderr)


def test_no_api_key() -> None:
    r = run("ls", "--api-url", "http://127.0.0.1:9")
    assert r.exit_code == 1
    assert one_error_line(r.stderr).startswith("error: unauthorized: no API key")


def test_exec_bad_timeout_fails_before_connecting() -> None:
    r = run("exec", "sbx-x", "--timeout", "abc", *DEAD, "--", "true")
    assert r.exit_code in (1, 2)
    line = one_error_line(r.stderr)
    assert "duration" in line and "abc" in line


@pytest.mark.parametrize("args", [["create", "--timeout", "soon"],
                                  ["timeout", "sbx-x", "0s"],
                                  ["create", "--idle-timeout", "later"],
                                  ["timeout", "sbx-x", "--idle-timeout", "-1m"]])
def test_bad_durations(args: list[str]) -> None:
    r = run(*args, *DEAD)
    assert r.exit_code == 1
    assert "duration" in one_error_line(r.stderr)


def test_env_needs_key_value() -> None:
    r = run("exec", "sbx-x", "--env", "NOVALUE", *DEAD, "--", "true")
    assert r.exit_code == 2
    assert "KEY=VALUE" in r.stderr


def test_usage_error_exits_2() -> None:
    assert run("info").exit_code == 2
    assert run("exec", "sbx-x").exit_code == 2
    assert run("nosuchcommand").exit_code == 2


def test_files_put_missing_local_file(tmp_path: Path) -> None:
    r = run("files", "put", "sbx-x", str(tmp_path / "nope"), "/work/x", *DEAD)
    assert r.exit_code == 1
    assert one_error_line(r.stderr).startswith("error: not_found: local file")


# ---- with a fake SDK ----------------------------------------------------------------------
class FakeFiles:
    def __init__(self, store: dict[str, bytes]) -> None:
        self.store = store

    def read(self, path: str) -> bytes:
        if path not in self.store:
            raise NotFound(f"no such file: {path}")
        return self.store[path]

    def download(self, path: str, local: Path) -> int:
        with open(local, "wb") as f:
            f.write(b"partial")
            data = self.read(path)
            f.write(data)
        return len(data)

    def list(self, path: str) -> list[FileEntry]:
        return [FileEntry("a.txt", f"{path}/a.txt", "file", 5, 0o644, 0.0),
                FileEntry("[sub]", f"{path}/[sub]", "dir", 4096, 0o755, 0.0)]


class FakeSandbox:
    calls: ClassVar[list[tuple[str, Any]]] = []
    result = ExecResult(exit_code=3, stdout_bytes=b"", stderr_bytes=b"", duration=0.1)
    store: ClassVar[dict[str, bytes]] = {"/work/a.bin": b"\x00\xffraw"}

    def __init__(self, sid: str) -> None:
        self.id = sid
        self.files = FakeFiles(self.store)
        self.closed = False

    @classmethod
    def connect(cls, sandbox_id: str, *, auto_resume: bool = True,
                api_url: str | None = None, api_key: str | None = None) -> FakeSandbox:
        """Sandbox.connect's signature (test_fake_matches_the_sdk checks it)."""
        if sandbox_id == "sbx-gone":
            raise NotFound(f"sandbox {sandbox_id!r} not found")
        cls.calls.append(("connect", (sandbox_id, {"auto_resume": auto_resume,
                                                   "api_url": api_url, "api_key": api_key})))
        return cls(sandbox_id)

    def exec(self, cmd: Any, **kw: Any) -> ExecResult:
        self.calls.append(("exec", (cmd, kw)))
        kw["on_stdout"]("out-1\n")
        kw["on_stderr"]("err-1\n")
        kw["on_stdout"]("out-2 é\n")
        return self.result

    def close(self) -> None:
        self.calls.append(("close", self.id))


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> type[FakeSandbox]:
    FakeSandbox.calls = []
    FakeSandbox.result = ExecResult(exit_code=3, stdout_bytes=b"", stderr_bytes=b"",
                                    duration=0.1)
    monkeypatch.setattr(cli, "Sandbox", FakeSandbox)
    return FakeSandbox


def test_exec_streams_and_exits_with_the_code(fake: type[FakeSandbox]) -> None:
    r = run("exec", "sbx-a", "--timeout", "2m", "--env", "A=1=2", "--cwd", "/tmp", "--",
            "echo hi && false")
    assert r.exit_code == 3
    assert r.stdout == "out-1\nout-2 é\n"
    assert r.stderr == "err-1\n"
    (cmd, kw), = [c[1] for c in fake.calls if c[0] == "exec"]
    assert cmd == "echo hi && false"  # one argument: a shell line
    assert kw["timeout"] == "2m" and kw["cwd"] == "/tmp" and kw["env"] == {"A": "1=2"}
    assert fake.calls[-1] == ("close", "sbx-a")


def test_exec_several_args_is_an_argv(fake: type[FakeSandbox]) -> None:
    r = run("exec", "sbx-a", "--", "python", "-c", "print(1)")
    (cmd, _), = [c[1] for c in fake.calls if c[0] == "exec"]
    assert cmd == ["python", "-c", "print(1)"]
    assert r.exit_code == 3


def test_exec_timed_out_is_124(fake: type[FakeSandbox]) -> None:
    fake.result = ExecResult(exit_code=137, stdout_bytes=b"", stderr_bytes=b"", duration=1,
                             timed_out=True)
    r = run("exec", "sbx-a", "--timeout", "1s", "--", "sleep 9")
    assert r.exit_code == 124
    assert "timed out" in r.stderr


def test_exec_stdin(fake: type[FakeSandbox]) -> None:
    run("exec", "sbx-a", "-i", "--", "cat", input=b"hello")
    (_, kw), = [c[1] for c in fake.calls if c[0] == "exec"]
    assert kw["stdin"] == b"hello"


def test_not_found_sandbox(fake: type[FakeSandbox]) -> None:
    r = run("exec", "sbx-gone", "--", "true")
    assert r.exit_code == 1
    assert one_error_line(r.stderr) == "error: not_found: sandbox 'sbx-gone' not found"


def test_files_get_to_stdout_is_raw(fake: type[FakeSandbox]) -> None:
    r = run("files", "get", "sbx-a", "/work/a.bin")
    assert r.exit_code == 0
    assert r.stdout_bytes == b"\x00\xffraw"


def test_files_get_to_file_and_dir(fake: type[FakeSandbox], tmp_path: Path) -> None:
    r = run("files", "get", "sbx-a", "/work/a.bin", str(tmp_path / "x.bin"))
    assert r.exit_code == 0, r.stderr
    assert (tmp_path / "x.bin").read_bytes() == b"partial\x00\xffraw"
    r = run("files", "get", "sbx-a", "/work/a.bin", str(tmp_path))
    assert (tmp_path / "a.bin").exists()


def test_files_get_failure_leaves_no_file(fake: type[FakeSandbox], tmp_path: Path) -> None:
    r = run("files", "get", "sbx-a", "/work/missing", str(tmp_path / "x"))
    assert r.exit_code == 1
    assert one_error_line(r.stderr).startswith("error: not_found: ")
    assert list(tmp_path.iterdir()) == []


def test_files_ls_table(fake: type[FakeSandbox]) -> None:
    r = run("files", "ls", "sbx-a")
    assert r.exit_code == 0
    assert "0644" in r.stdout and "a.txt" in r.stdout
    assert "[sub]/" in r.stdout and "0755" in r.stdout


def test_fake_matches_the_sdk() -> None:
    import inspect

    from cpuos import Sandbox

    for name in ("connect",):
        fake, real = (inspect.signature(getattr(c, name)) for c in (FakeSandbox, Sandbox))
        assert fake.parameters == real.parameters, name


@pytest.mark.parametrize("argv", [["info", "sbx-1"], ["kill", "sbx-1"],
                                  ["timeout", "sbx-1", "5m"]])
def test_inspecting_or_killing_never_resumes(fake: type[FakeSandbox], argv: list[str]) -> None:
    runner.invoke(cli.app, argv)
    resumes = [c[1][1]["auto_resume"] for c in fake.calls if c[0] == "connect"]
    assert resumes and not any(resumes), fake.calls


def test_exec_resumes_a_paused_sandbox(fake: type[FakeSandbox]) -> None:
    r = runner.invoke(cli.app, ["exec", "sbx-1", "--", "true"])
    assert r.exit_code == 3, r.output
    assert [c[1][1]["auto_resume"] for c in fake.calls if c[0] == "connect"] == [True]


def test_cli_and_sdk_import_no_server_code() -> None:
    """Layering: the CLI and SDK talk to the daemon over its API only."""
    import subprocess
    import sys

    code = ("import sys, cpuos, cpuos.cli.main; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'cpuosd'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True)
    assert r.stdout.strip() == "[]"
