"""Issue 25, finding 13: template build steps (a spec's run steps, a Dockerfile's RUN, pip and
npm installs) ran as root in a chroot on the host with /proc and /dev mounted: a Dockerfile
from an untrusted repository owned the host. They now run in a runsc sandbox over the tree.

- ``test_a_build_step_cannot_touch_the_host``: real runsc, a tiny busybox root: a step as
  root tries the host's files through /proc/1/root, a host path, a symlink, a /tmp swapped
  for a link to the host; mounts, device nodes, signals to a host process and a host
  loopback server. The host side is checked, not the step's error.
- ``test_build_steps_network_is_a_sandbox_policy``: the same runner with a network namespace
  attached to a real cpuosd.network.Network (nftables, resolver, egress proxy) whose uplink
  leads into a fake internet, as the daemon attaches one for a build: each step (runsc takes
  the namespace's address; the runner gives it back) reaches the allowed name, and neither
  another name nor a private address; the records say so.
- ``test_dockerfile_build_network_is_a_sandbox_policy`` (slow: mmdebstrap): a Dockerfile
  built through the daemon, whose uplink leads into a fake internet: RUN reaches the name
  the build's policy allows and nothing else (another name, a private address), each
  attempt is a line of the build log, and the build's RUN cannot write to the host either.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import secrets
import socket
import stat
import subprocess
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cpuosd.config import Config
from support.fakenet import WEB, FakeInternet
from cpuosd.network.policy import Policy
from cpuosd.network.service import Network
from cpuosd.templates.builder import TemplateError, run_steps, shell_steps
from cpuosd.templates.stepbox import StepBox
from support.daemon import (
    Daemon,
    build_steps_left,
    e2e_unavailable,
    net_slot_env,
    new_daemon,
    wait_until,
)

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (runsc)")]


@pytest.fixture
def root(busybox_tree: Path) -> Path:
    return busybox_tree


def test_a_build_step_cannot_touch_the_host(root: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"  # a host directory with a secret in it
    outside.mkdir()
    (outside / "secret").write_text("host secret\n")
    marker = f"/tmp/cpuos-build-pwned-{secrets.token_hex(4)}"
    sleeper = subprocess.Popen(["sleep", "300"])
    seen: list[object] = []
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    port = srv.getsockname()[1]

    def accept() -> None:
        try:
            seen.append(srv.accept()[1])
        except OSError:
            pass

    threading.Thread(target=accept, daemon=True).start()
    lines: list[str] = []
    try:
        run_steps(root, shell_steps([
            # (under chroot /proc/1 was the host's init: its root the host's /)
            f"echo pwned > /proc/1/root{marker} && cat {marker} || echo refused-proc1",
            f"cat {outside}/secret || echo no-host-path",
            f"ln -s {outside} /escape && echo x > /escape/f || echo no-link-out",
            "mount -t tmpfs x /work || echo no-mount",
            "mount -t proc proc /work || echo no-mount-proc",
            "mknod /blk b 8 0 || echo no-mknod-root",
            "mknod /dev/blk b 8 0 && cat /dev/blk | wc -c || echo no-block-device",
            f"kill -9 {sleeper.pid} || echo no-kill",
            f"nc -w 2 127.0.0.1 {port} </dev/null && echo connected || echo no-host-loopback",
            # the tree's /tmp is bound into the step (a mount point: it cannot be swapped for
            # a link); a link in it to the host directory means the tree's path
            "rm -rf /tmp || echo tmp-stays",
            f"ln -s {outside} /tmp/link",
            "echo y > /tmp/link/g || echo no-link-out-tmp",
        ]), on_line=lines.append)
    finally:
        srv.close()
        alive = sleeper.poll() is None
        sleeper.kill()
        sleeper.wait()
    out = "\n".join(lines)
    # the host is as it was
    assert not os.path.exists(marker), out
    assert "pwned" in lines  # it wrote: /proc/1/root is the sandbox's own root (the tree)
    assert sorted(os.listdir(outside)) == ["secret"], out
    assert (outside / "secret").read_text() == "host secret\n"
    assert alive, "a build step killed a host process"
    assert seen == [], "a build step reached a host loopback server"
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            mode = os.lstat(os.path.join(dirpath, n)).st_mode
            assert not (stat.S_ISBLK(mode) or stat.S_ISCHR(mode)), f"device node {n} in tree"
    # and the step saw its own world, not the host's
    for word in ("no-host-path", "no-mount", "no-mount-proc", "no-mknod-root", "no-kill",
                 "no-host-loopback", "tmp-stays"):
        assert word in lines, (word, out)
    assert "host secret" not in out
    assert build_steps_left(root) == []


def test_a_step_without_runsc_is_refused_not_run_on_the_host(
        root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CPUOS_RUNSC", str(tmp_path / "no-such-runsc"))
    with pytest.raises(TemplateError, match="run in a runsc sandbox"):
        run_steps(root, shell_steps(["touch /ran"]))
    assert not (root / "ran").exists()


# ---- a network: the build's namespace on a real cpuosd network, a fake internet ------------
@pytest.fixture(scope="module")
def inet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeInternet]:
    why = e2e_unavailable()
    if why:
        pytest.skip(why)
    f = FakeInternet(tmp_path_factory.mktemp("inet")).start()
    yield f
    f.stop()


def http_get(ip: str, host: str, path: str = "/ok") -> str:
    """A step's plaintext HTTP request to ``ip`` naming ``host`` (busybox nc)."""
    return (f"printf 'GET {path} HTTP/1.0\\r\\nHost: {host}\\r\\n\\r\\n' | "
            f"nc -w 10 {ip} 80 | head -1")


def test_build_steps_network_is_a_sandbox_policy(root: Path, tmp_path: Path,
                                                 inet: FakeInternet) -> None:
    (root / "bin" / "nslookup").symlink_to("sh")
    (root / "bin" / "head").symlink_to("sh")
    (root / "etc").mkdir()
    (root / "etc/resolv.conf").write_text("nameserver 10.255.255.53\n")  # any: redirected
    records: list[dict[str, object]] = []
    lines: list[str] = []
    with net_slot_env() as env:
        cfg = Config.from_env({**os.environ, **env, **inet.env()})

        async def build() -> None:
            net = Network(lambda sid, rec: records.append({"sid": sid, **rec}),
                          tmp_path / "secrets", cfg.network)
            await net.start()
            try:
                slot = await net.attach("build-t", Policy.parse({"allow": ["allowed.test"]}))
                try:
                    await asyncio.to_thread(run_steps, root, shell_steps([
                        "nslookup allowed.test",
                        http_get(WEB, "allowed.test"),  # a second step: the address is back
                        "nslookup other.test || echo other-refused",
                        http_get(WEB, "other.test") + " || true; echo other-done",
                        http_get("10.9.9.9", "10.9.9.9") + " || true; echo private-done",
                    ]), on_line=lines.append, box=StepBox.default(slot.netns_path, cfg))
                finally:
                    await net.detach("build-t")
            finally:
                await net.close()

        asyncio.run(build())
    out = "\n".join(lines)
    assert f"Address: {WEB}" in out, out
    ok = [x for x in lines if x.startswith("HTTP/1.") and " 200 OK" in x]
    assert len(ok) == 1, out  # the allowed name's request, and only it
    assert "other-refused" in lines and "other-done" in lines and "private-done" in lines
    assert all(r["sid"] == "build-t" for r in records)
    seen = [(r["proto"], r.get("name") or r.get("dst"), r["verdict"]) for r in records]
    assert ("dns", "allowed.test", "allowed") in seen and ("dns", "other.test", "denied") in seen
    assert ("tcp", "allowed.test", "allowed") in seen, seen
    assert any(p == "tcp" and v == "denied" and n in ("other.test", "10.9.9.9")
               for p, n, v in seen), seen
    web = [x for x in inet.seen() if x["listener"] == f"{WEB}:80"]
    assert len(web) == 1 and "Host: allowed.test" in web[0]["data"], web
    assert not any(x["listener"].startswith("10.9.9.9") for x in inet.seen())
    assert build_steps_left(root) == []


# ---- through the daemon, with a network (slow: mmdebstrap) ----------------------------------
@pytest.fixture(scope="module")
def bdaemon(inet: FakeInternet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon whose uplink is the fake internet, whose builds may reach allowed.test."""
    d = new_daemon(CPUOS_TEMPLATES_DIR=str(tmp_path_factory.mktemp("templates")),
                   CPUOS_POOL_SIZE="0", CPUOS_BUILD_NETWORK="allowed.test", **inet.env())
    d.start()
    yield d
    assert not d.teardown(False)


GET = "python3 -c \"import urllib.request as u; print('got', u.urlopen('{}', timeout=20).status)\""
DOCKERFILE = f"""FROM debian:bookworm
RUN {GET.format("http://allowed.test/ok")}
RUN {GET.format("http://other.test/")} || echo other-refused
RUN {GET.format("http://10.9.9.9/")} || echo private-refused
RUN echo pwned > /proc/1/root{{marker}} || true; echo built > /built
"""


@pytest.mark.slow
def test_dockerfile_build_network_is_a_sandbox_policy(bdaemon: Daemon, inet: FakeInternet) -> None:
    marker = f"/tmp/cpuos-build-pwned-{secrets.token_hex(4)}"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        raw = DOCKERFILE.format(marker=marker).encode()
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(raw)
        t.addfile(info, io.BytesIO(raw))
    events = []
    with bdaemon.client() as c, c.stream(
            "POST", "/templates/build", params={"file": "Dockerfile", "name": "netcheck"},
            content=buf.getvalue(), timeout=httpx.Timeout(30, read=1800)) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            events.append(json.loads(line))
    log = [e["log"] for e in events if "log" in e]
    text = "\n".join(log)
    assert "result" in events[-1], (events[-1], text[-6000:])
    assert "got 200" in log, text[-3000:]
    assert "other-refused" in log and "private-refused" in log, text[-3000:]
    # the connections, as the build's policy saw them
    assert any(x.startswith("net: allowed") and "allowed.test:80" in x for x in log), text
    assert any(x.startswith("net: denied") and "other.test" in x for x in log), text
    assert any(x.startswith("net: denied") and "10.9.9.9" in x for x in log), text
    # the servers' side: the allowed name was reached, the private address never
    seen = inet.seen()
    assert any(s["listener"].startswith(f"{WEB}:80") and "/ok" in s["data"] for s in seen)
    assert not any(s["listener"].startswith("10.9.9.9") for s in seen), seen
    assert not os.path.exists(marker)
    rootfs = Path(events[-1]["result"]["rootfs"])
    assert (rootfs / "built").read_text() == "built\n"
    # the build's namespace is gone with it (the one left is the daemon's spare)
    wait_until(lambda: sum(x.startswith("netns") for x in bdaemon.network_leftovers()) <= 1,
               "the build's network namespace is removed", timeout=60)
