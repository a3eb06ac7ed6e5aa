"""Regenerate the Python code for ``pdserve.proto`` and ``worker.proto`` (``make proto``).

The contracts import each other as ``pdserve/proto/*.proto``, the path they have in an installed
wheel, so the generated modules import ``pdserve.proto.*_pb2``. The repository keeps them in
``proto/``, so they are staged under ``pdserve/proto/`` in a scratch directory for ``protoc``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTOS = ("pdserve.proto", "worker.proto")
GENERATED = tuple(f"{stem}{suffix}" for stem in ("pdserve", "worker")
                  for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"))


def generate(out_dir: Path) -> None:
    """Write the files of :data:`GENERATED` for the ``.proto`` files beside this module into ``out_dir``.

    Raises:
        subprocess.CalledProcessError: ``grpc_tools.protoc`` failed (its message is on stderr).
    """
    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / "pdserve" / "proto"
        staged.mkdir(parents=True)
        for name in PROTOS:
            shutil.copy(HERE / name, staged / name)
        subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.", "--grpc_python_out=.",
                        "--pyi_out=.", *(f"pdserve/proto/{name}" for name in PROTOS)], cwd=tmp, check=True)
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in GENERATED:
            shutil.copy(staged / name, out_dir / name)


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
