"""Regenerates the checked-in gRPC stubs from proto/: `python -m services.rpc.regen [OUT_DIR]`.

protoc writes `from splitserve.v1 import x_pb2`; the stubs live under `services.rpc`, so the
imports are rewritten to `from services.rpc.splitserve.v1 import x_pb2`. The test that the
checked-in stubs are current runs this into a temporary directory and compares.
"""

import re
import sys
from pathlib import Path

from grpc_tools import protoc

REPO = Path(__file__).resolve().parents[2]
PROTO_DIR = REPO / "proto"
PROTOS = ["splitserve/v1/generation.proto", "splitserve/v1/control.proto",
          "splitserve/v1/kvcache.proto"]


def regenerate(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    include = str(Path(protoc.__file__).parent / "_proto")
    args = ["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *PROTOS]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    for path in (out_dir / "splitserve" / "v1").glob("*.py*"):
        text = re.sub(r"^from splitserve\.v1 import", "from services.rpc.splitserve.v1 import",
                      path.read_text(), flags=re.M)
        path.write_text(text)
    for pkg in (out_dir / "splitserve", out_dir / "splitserve" / "v1"):
        (pkg / "__init__.py").write_text("")


if __name__ == "__main__":
    regenerate(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "services" / "rpc")
