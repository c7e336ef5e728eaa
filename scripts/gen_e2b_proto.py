"""Generate the E2B envd message types and Connect service stubs (src/cpuosd/e2b/gen/) from
E2B's .proto files (src/cpuosd/e2b/proto/, copied from the public e2b-dev/E2B repository,
spec/envd/, Apache-2.0), with protoc from grpcio-tools and the protobuf-py / connectrpc
plugins at the versions the ``e2b`` SDK itself pins (so daemon and SDK share one runtime):

    pip install grpcio-tools 'protoc-gen-py==0.6.0' 'protoc-gen-connectrpc==0.12.1'
    python scripts/gen_e2b_proto.py          # write
    python scripts/gen_e2b_proto.py --check  # exit 1 if the committed code is stale
"""

from __future__ import annotations

import filecmp
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "src" / "cpuosd" / "e2b" / "proto"
OUT = ROOT / "src" / "cpuosd" / "e2b" / "gen"
FILES = ["process/process.proto", "filesystem/filesystem.proto"]


def plugin(name: str) -> str:
    found = shutil.which(name, path=os.pathsep.join([str(Path(sys.executable).parent),
                                                     os.environ.get("PATH", "")]))
    if not found:
        raise SystemExit(f"{name} not found: pip install grpcio-tools 'protoc-gen-py==0.6.0' "
                         "'protoc-gen-connectrpc==0.12.1'")
    return found


def generate(dest: Path) -> None:
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/timestamp.proto
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO}", f"-I{include}",
                    f"--plugin=protoc-gen-py={plugin('protoc-gen-py')}",
                    f"--plugin=protoc-gen-connectrpc={plugin('protoc-gen-connectrpc')}",
                    f"--py_out={dest}", f"--connectrpc_out={dest}", *FILES],
                   check=True, cwd=PROTO)


def main() -> int:
    check = "--check" in sys.argv[1:]
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        new = sorted(p.relative_to(tmp) for p in Path(tmp).rglob("*.py"))
        if check:
            old = sorted(p.relative_to(OUT) for p in OUT.rglob("*.py"))
            stale = [str(p) for p in new if not (OUT / p).exists()
                     or not filecmp.cmp(Path(tmp) / p, OUT / p, shallow=False)]
            stale += [str(p) for p in old if p not in new]
            if stale:
                print("stale generated E2B code: " + ", ".join(stale) +
                      " (run python scripts/gen_e2b_proto.py)", file=sys.stderr)
                return 1
            return 0
        shutil.rmtree(OUT, ignore_errors=True)
        for p in new:
            (OUT / p).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(Path(tmp) / p, OUT / p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
