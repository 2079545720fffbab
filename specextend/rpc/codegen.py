"""Regenerates the committed gRPC stubs from protos/ (dev tool; needs the `dev` extra).

    python -m specextend.rpc.codegen          # rewrites specextend/v1/draft_pb2*.py in place

The stubs must come from grpcio-tools==1.84.0: stubs from newer tools refuse to load with the
grpcio 1.84.0 of the GPU machines (docs/architecture.md, "Wire protocol").
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO = "specextend/v1/draft.proto"  # relative to protos/; also the stubs' package path
STUBS = ("specextend/v1/draft_pb2.py", "specextend/v1/draft_pb2_grpc.py")  # relative to out_dir
GRPCIO_TOOLS_VERSION = "1.84.0"


def generate(out_dir: Path = REPO_ROOT) -> list[Path]:
    """Runs protoc as docs/architecture.md, "Wire protocol", says, writing the stubs under out_dir; returns their paths."""
    out_dir = Path(out_dir).resolve()
    subprocess.run(
        [
            sys.executable, "-m", "grpc_tools.protoc", "-I", "protos",
            f"--python_out={out_dir}", f"--grpc_python_out={out_dir}", f"protos/{PROTO}",
        ],
        cwd=REPO_ROOT,
        check=True,
    )
    return [out_dir / stub for stub in STUBS]


if __name__ == "__main__":
    for path in generate():
        print(path)
