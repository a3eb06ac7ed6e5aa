"""The committed generated code equals what `make proto` produces from the .proto files."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ["pdserve_pb2.py", "pdserve_pb2.pyi", "pdserve_pb2_grpc.py", "worker_pb2.py", "worker_pb2.pyi",
             "worker_pb2_grpc.py"]


def test_generated_code_is_up_to_date(tmp_path):
    (tmp_path / "proto").mkdir()
    for name in ("pdserve.proto", "worker.proto"):
        shutil.copy(ROOT / "proto" / name, tmp_path / "proto" / name)
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.", "--grpc_python_out=.",
                    "--pyi_out=.", "proto/pdserve.proto", "proto/worker.proto"], cwd=tmp_path, check=True)
    stale = [n for n in GENERATED if (tmp_path / "proto" / n).read_text() != (ROOT / "proto" / n).read_text()]
    assert not stale, f"run `make proto`: stale generated files {stale}"
