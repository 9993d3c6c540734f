"""Regenerate the committed Python stubs of protos/tandem/v1 (`make protos`).

protoc runs with `protos/` as the include root so the descriptors keep their canonical
names (`tandem/v1/executor.proto`, as grpcurl and reflection see them); the imports in the
generated modules are then rewritten to the `protos.tandem.v1` package this repo installs.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_DIR = PROTO_ROOT / "tandem" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_root: Path) -> list[Path]:
    """Run protoc into `out_root` (mirroring `tandem/v1/`) and return the generated files."""
    from grpc_tools import protoc

    sources = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_DIR.glob("*.proto"))
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    files = sorted(p for p in (out_root / "tandem" / "v1").iterdir() if p.name.endswith(GENERATED_SUFFIXES))
    for path in files:
        text = re.sub(
            r"^from tandem\.v1 import", "from protos.tandem.v1 import", path.read_text(), flags=re.M
        )
        path.write_text(text)
    return files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the committed stubs are stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        stale = []
        for path in generate(Path(tmp)):
            target = PROTO_DIR / path.name
            if args.check:
                if not target.exists() or target.read_text() != path.read_text():
                    stale.append(target.name)
            else:
                target.write_text(path.read_text())
        if stale:
            print(f"stale generated stubs: {', '.join(stale)}; run `make protos`", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
