"""The committed generated code equals what `make proto` produces from the .proto files."""

from __future__ import annotations

from pathlib import Path

from pdserve.proto.codegen import GENERATED, generate

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_up_to_date(tmp_path):
    generate(tmp_path)
    stale = [n for n in GENERATED if (tmp_path / n).read_text() != (ROOT / "proto" / n).read_text()]
    assert not stale, f"run `make proto`: stale generated files {stale}"
