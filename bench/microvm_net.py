"""One-off measurement (not a bench case: TCG figures are no targets): download throughput of
a microVM sandbox's network with the guest emulated (TCG), the only way microVMs run on
hosts whose KVM fails the boot probe.

Per run, a file of N MiB served by ``python3 -m http.server`` inside the guest and fetched
from the host (a raw-socket client): (1) *direct*, to the guest's own address (the host end
of the sandbox's veth → tc redirect → tap → virtio-net), (2) through the daemon's *preview
proxy*; and (3) *egress*: curl inside the guest downloading N MiB from the fake internet's
web server in mode ``on`` (every TCP connection relayed by the egress proxy; curl's own
clock). One warm-up of each first (TCG translates the guest's code once). All traffic stays
in namespaces made here (support.fakenet is the daemon's uplink).

    sudo .venv/bin/python bench/microvm_net.py [MiB] [runs]
"""

from __future__ import annotations

import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # for `support`

from cpuos import Sandbox
from cpuosd.backends.microvm import guest_artifacts
from support.fakenet import WEB, FakeInternet
from support.daemon import Daemon

MiB = 1 << 20
ADDRESS = ("import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
           "s.connect(('198.51.100.1', 9)); print(s.getsockname()[0])")


def get(addr: tuple[str, int], path: str, headers: dict[str, str]) -> tuple[int, float]:
    """(bytes received, seconds) of one GET read to the end (Connection: close)."""
    s = socket.create_connection(addr, timeout=300)
    req = (f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
           + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n")
    t0 = time.perf_counter()
    s.sendall(req.encode())
    buf = bytearray(1 << 20)
    n = 0
    while k := s.recv_into(buf):
        n += k
    dt = time.perf_counter() - t0
    s.close()
    return n, dt


def main() -> None:
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    work = Path(tempfile.mkdtemp(prefix="cpuos-mvmnet-"))
    inet = FakeInternet(work).start()
    home = work / "home"
    home.mkdir()
    d = Daemon(home, {"CPUOS_BACKEND": "microvm", "CPUOS_MICROVM_ACCEL": "tcg",
                      "CPUOS_MICROVM_DIR": str(guest_artifacts.cache_dir()), "CPUOS_POOL_SIZE": "0",
                      "CPUOS_AGENT_CONNECT_TIMEOUT": "240", **inet.env()})
    d.start()
    try:
        with d.client() as c:
            r = c.post("/sandboxes", json={"template": "python", "timeout": "30m",
                                           "network": "on"}, timeout=900)
            r.raise_for_status()
            sid = r.json()["id"]
        s = Sandbox.connect(sid, **d.sdk_kwargs())
        s.exec(f"head -c {size}M /dev/zero > /work/big.bin", timeout="5m")
        s.exec("cd /work && nohup python3 -m http.server --protocol HTTP/1.1 8000 "
               ">/dev/null 2>&1 &")
        addr = s.exec(["python3", "-c", ADDRESS]).stdout.strip()
        with d.client() as c:
            p = c.post(f"/sandboxes/{sid}/ports", json={"port": 8000}).json()
        pport = int(p["url"].split("//")[1].split("/")[0].rsplit(":", 1)[1])
        path = f"/sandboxes/{sid}/ports/8000/big.bin"
        tok = {"X-Cpuos-Token": p["token"]}
        deadline = time.monotonic() + 120
        while True:
            try:
                get((addr, 8000), "/", {})
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        curl = ["curl", "-sS", "-o", "/dev/null", "-w", "%{size_download} %{time_total}",
                f"http://{WEB}/bytes/{size * MiB}"]

        def direct() -> float:
            n, dt = get((addr, 8000), "/big.bin", {})
            assert n > size * MiB, n
            return size * MiB / dt / 1e6

        def proxy() -> float:
            n, dt = get(("127.0.0.1", pport), path, tok)
            assert n > size * MiB, n
            return size * MiB / dt / 1e6

        def egress() -> float:
            got, secs = s.exec(curl, timeout="10m").stdout.split()
            assert int(got) == size * MiB, got
            return size * MiB / float(secs) / 1e6

        ways = {"direct (host -> guest)": direct, "preview proxy": proxy,
                "egress proxy (mode on)": egress}
        for f in ways.values():
            f()  # warm-up
        res: dict[str, list[float]] = {k: [] for k in ways}
        for _ in range(runs):  # interleaved: the host's load hits each alike
            for k, f in ways.items():
                res[k].append(f())
        for k, v in res.items():
            print(f"{k:24s} median {statistics.median(v):6.1f} MB/s  "
                  f"(min {min(v):.1f}, max {max(v):.1f}; {size} MiB x {runs})")
        ratio = (statistics.median(res["preview proxy"])
                 / statistics.median(res["direct (host -> guest)"]))
        print(f"preview proxy / direct: {ratio:.2f}")
        s.kill()
    finally:
        d.teardown(False)
        inet.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
