"""Many hosts on one host (issue 24): what the API tier costs, and pause -> resume on
another node.

    .venv/bin/python bench/cluster.py [--quick | --smoke]     # as root

Starts a real Postgres, an S3 server (moto) on 127.0.0.1, two node processes
(``cpuosd --role=node``, real runsc) and one API process (``--role=api``), as
tests/cluster/test_two_nodes.py does (tests/support/testbed.py: node_cluster). The same HTTP
client code (httpx, one kept-alive connection) measures each path twice, through the API
process and straight to the node (with the node token), on the same sandbox:

- exec round trip of ``true`` (the whole framed answer read): p50 and p99, and the API
  tier's overhead (the median of paired differences: the two paths alternate, so each pair
  sees the same moment of the host's load);
- stdout streaming (``head -c 64M /dev/zero``, the framed stream read to its end): MB/s,
  the two paths alternating as well; the ratio is the median of the pairs' ratios (one
  path alone spreads 35-112 MB/s here with the host's load, which a pair shares);
- a preview request (``GET /index.html`` of ``python -m http.server`` in the sandbox, a
  public port, host form) through the API process's preview listener and straight to the
  node's: p50 and the overhead;
- pause -> resume of an idle python sandbox: on the same node with no snapshot store
  (checkpoint and restore from local disk) beside pause (checkpoint + upload) on node A ->
  resume (download + restore) on node B through the S3 store.

Prints the figures beside each other; the samples go to .cache/bench/cluster[-mode].json.
The test suite runs ``--smoke`` (tests/cluster/test_bench_cluster.py)."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / ".cache" / "bench"
sys.path.insert(0, str(REPO / "tests"))  # for `support`


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * p / 100))]


def exec_times(c: httpx.Client, sid: str, cmd: str, n: int) -> tuple[list[float], int]:
    lat, size = [], 0
    for _ in range(n):
        t0 = time.perf_counter()
        r = c.post(f"/sandboxes/{sid}/exec", json={"cmd": cmd, "timeout": 120})
        body = r.content
        lat.append(time.perf_counter() - t0)
        if r.status_code != 200:
            raise RuntimeError(f"exec {cmd!r}: {r.status_code} {body[:300]!r}")
        size = len(body)
    return lat, size


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    mode = "smoke" if a.smoke else "quick" if a.quick else "full"
    n_exec = {"smoke": 5, "quick": 50, "full": 300}[mode]
    n_stream = {"smoke": 1, "quick": 6, "full": 16}[mode]
    n_pause = {"smoke": 1, "quick": 2, "full": 5}[mode]
    stream_mib = {"smoke": 4, "quick": 64, "full": 64}[mode]

    from cpuos import Sandbox
    from support import testbed
    from support.daemon import e2e_unavailable, wait_until

    why = e2e_unavailable() or testbed.postgres_unavailable() or testbed.s3_unavailable()
    if why:
        print(f"bench/cluster.py cannot run here: {why}", file=sys.stderr)
        return 2
    out: dict[str, Any] = {"mode": mode}
    base = Path(os.environ.get("TMPDIR", "/tmp"))
    with testbed.postgres() as pg:
        s3 = testbed.S3Server(Path(tempfile.mkdtemp(prefix="cpuos-s3-", dir=base)))
        s3.start()
        try:
            bucket = "bench-" + secrets.token_hex(4)
            s3.create_bucket(bucket)
            url = pg.create_database("bench_" + secrets.token_hex(4))
            with testbed.node_cluster(url, s3.env(bucket), n_apis=1) as cl:
                api, node_a = cl.apis[0], cl.nodes[0]
                store = testbed.open_test_store(url)
                auth = {"Authorization": f"Bearer {cl.key}"}

                def only(node: str) -> None:
                    for n in ("node-a", "node-b"):
                        store.set_node_cordoned(n, True)
                    wait_until(lambda: api.health().get("nodes_placeable") == 0,
                               "both nodes cordoned", timeout=15)
                    store.set_node_cordoned(node, False)
                    wait_until(lambda: api.health().get("nodes_placeable") == 1,
                               "placement on " + node, timeout=15)

                only("node-a")
                sbx = Sandbox.create(template="python", timeout="30m", api_url=api.url,
                                     api_key=cl.key)
                row = store.get_sandbox(sbx.id)
                assert row is not None and row.node_id == "node-a", row
                with httpx.Client(base_url=api.url, headers=auth, timeout=300) as via_api, \
                        httpx.Client(base_url=node_a.url, timeout=300, headers={
                            **auth, "X-Cpuos-Node-Token": cl.token}) as direct:
                    for c in (via_api, direct):  # warm-up
                        exec_times(c, sbx.id, "true", 3)
                    # interleaved, the order alternating: each pair sees the same moment of
                    # a shared host's load; the overhead is the median of the pairs' differences
                    lat_api: list[float] = []
                    lat_node: list[float] = []
                    for i in range(n_exec):
                        pair = ((via_api, lat_api), (direct, lat_node))
                        for c, into in (pair if i % 2 == 0 else pair[::-1]):
                            into += exec_times(c, sbx.id, "true", 1)[0]
                    for name, lat in (("api", lat_api), ("node", lat_node)):
                        out[f"exec_{name}_s"] = lat
                        print(f"exec 'true' via {name}: p50 {statistics.median(lat) * 1e3:.2f} "
                              f"ms, p99 {pct(lat, 99) * 1e3:.2f} ms")
                    out["exec_overhead_s"] = [a - b for a, b in zip(lat_api, lat_node, strict=True)]
                    cmd = f"head -c {stream_mib}M /dev/zero"
                    mbps: dict[str, list[float]] = {"api": [], "node": []}
                    for i in range(n_stream):  # (interleaved too, the order alternating)
                        two = (("api", via_api), ("node", direct))
                        for name, c in (two if i % 2 == 0 else two[::-1]):
                            lat, size = exec_times(c, sbx.id, cmd, 1)
                            mbps[name].append(size / lat[0] / 1e6)
                    for name in ("api", "node"):
                        out[f"stream_{name}_MBps"] = mbps[name]
                        print(f"stdout stream {stream_mib} MiB via {name}: "
                              f"{statistics.median(mbps[name]):.0f} MB/s")
                    out["stream_ratio"] = [a / b for a, b in zip(mbps["api"], mbps["node"],
                                                                 strict=True)]

                # a preview request: API tier's preview relay vs the node's preview listener
                sbx.exec("mkdir -p /work/site && echo hi > /work/site/index.html && "
                         "cd /work/site && nohup python3 -m http.server 3000 >/dev/null 2>&1 &")
                httpx.post(f"{api.url}/sandboxes/{sbx.id}/ports", headers=auth,
                           json={"port": 3000, "public": True}).raise_for_status()
                facts = next(n["facts"] for n in store.list_nodes() if n["id"] == "node-a")
                for name, base in (("api", api.preview_url),
                                   ("node", f"http://{facts['preview_address']}")):
                    with httpx.Client(base_url=base, timeout=60, headers={
                            "Host": f"3000-{sbx.id}.localhost"}) as c:
                        wait_until(lambda c=c: c.get("/index.html").status_code == 200,
                                   "the server in the sandbox", timeout=60)
                        lat = []
                        for _ in range(n_exec):
                            t0 = time.perf_counter()
                            r = c.get("/index.html")
                            lat.append(time.perf_counter() - t0)
                            assert r.status_code == 200 and r.text == "hi\n", r.text
                        out[f"preview_{name}_s"] = lat
                        print(f"preview GET via {name}: p50 {statistics.median(lat) * 1e3:.2f} "
                              f"ms, p99 {pct(lat, 99) * 1e3:.2f} ms")

                # pause -> resume: on node A from its disk (no store) vs A -> B via S3
                local_p, local_r, far_p, far_r = [], [], [], []
                for _ in range(n_pause):
                    only("node-a")
                    s = Sandbox.create(template="python", timeout="30m", api_url=api.url,
                                       api_key=cl.key)
                    s.exec("true")
                    t0 = time.perf_counter()
                    s.pause()
                    far_p.append(time.perf_counter() - t0)
                    only("node-b")
                    t0 = time.perf_counter()
                    r = httpx.post(f"{api.url}/sandboxes/{s.id}/resume", headers=auth,
                                   timeout=300)
                    far_r.append(time.perf_counter() - t0)
                    assert r.status_code == 200, r.text
                    row = store.get_sandbox(s.id)
                    assert row is not None and row.node_id == "node-b", row
                    s.kill()
                out["pause_upload_s"], out["resume_download_s"] = far_p, far_r
                store.close()

        finally:
            s3.stop()
            shutil.rmtree(s3.base, ignore_errors=True)
        # the local figure: one host (--role=all, local snapshots), same sandbox kind
        from support.daemon import new_daemon

        d = new_daemon(CPUOS_POOL_SIZE="0")
        try:
            d.start()
            for _ in range(n_pause):
                s = Sandbox.create(template="python", timeout="30m", **d.sdk_kwargs())
                s.exec("true")
                t0 = time.perf_counter()
                s.pause()
                local_p.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                s = Sandbox.resume(s.id, **d.sdk_kwargs())
                local_r.append(time.perf_counter() - t0)
                s.kill()
        finally:
            left = d.teardown(False)
        if left:
            raise RuntimeError(f"left behind: {left}")
        out["pause_local_s"], out["resume_local_s"] = local_p, local_r

    def m(k: str) -> float:
        return statistics.median(out[k])

    print()
    print(f"{'':48} {'through API':>12} {'to the node':>12}")
    print(f"{'exec true round trip, p50 (ms)':48} {m('exec_api_s') * 1e3:>12.2f} "
          f"{m('exec_node_s') * 1e3:>12.2f}   overhead "
          f"{m('exec_overhead_s') * 1e3:.2f} ms (median of paired differences)")
    print(f"{'stdout streaming, median (MB/s)':48} {m('stream_api_MBps'):>12.0f} "
          f"{m('stream_node_MBps'):>12.0f}   ratio {m('stream_ratio'):.2f} (median of "
          f"paired ratios; {min(out['stream_ratio']):.2f}-{max(out['stream_ratio']):.2f})")
    print(f"{'preview GET round trip, p50 (ms)':48} {m('preview_api_s') * 1e3:>12.2f} "
          f"{m('preview_node_s') * 1e3:>12.2f}   overhead "
          f"{(m('preview_api_s') - m('preview_node_s')) * 1e3:.2f} ms")
    print(f"{'':48} {'A -> B (S3)':>12} {'one host':>12}")
    print(f"{'pause of an idle python sandbox, median (s)':48} {m('pause_upload_s'):>12.2f} "
          f"{m('pause_local_s'):>12.2f}")
    print(f"{'resume, median (s)':48} {m('resume_download_s'):>12.2f} "
          f"{m('resume_local_s'):>12.2f}")
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / ("cluster.json" if mode == "full" else f"cluster-{mode}.json")
    path.write_text(json.dumps(out, indent=1))
    print(f"samples: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
