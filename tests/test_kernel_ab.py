"""bench/kernel_ab.py, the A/B of a C kernel between two commits that docs/benchmarks.md cites: one revision
built twice from git gives bit-identical outputs, both builds are timed, and the decode-attention cases run
on the project's own build (paged_attention.c takes ~10 s to compile, too long to build twice here)."""

from __future__ import annotations

import platform
import shutil
import subprocess

import pytest

from pdserve.bench import kernel_ab
from pdserve.bench.common import ROOT
from pdserve.kernels.cpu import available, library

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64" or shutil.which("git") is None
    or subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode != 0,
    reason="needs x86-64 and a git checkout")


def _check(rows: list[dict]) -> None:
    assert rows
    for row in rows:
        assert row["A"] > 0 and row["B"] > 0
        assert row["max_abs_diff"] == 0.0, row["case"]


def test_one_revision_built_twice_from_git_gives_identical_outputs(tmp_path):
    if not available("prefill_attention_fma"):
        pytest.skip("prefill_attention_fma does not run on this CPU")
    builds = {side: kernel_ab.build("prefill_attention_fma", "HEAD", tmp_path / side) for side in "AB"}
    _check(kernel_ab.prefill_attention_cases(builds, 1))


def test_the_decode_attention_cases_compare_two_builds():
    fn = library("paged_attention").pd_paged_attention
    fn.argtypes, fn.restype = kernel_ab.SIGNATURES["paged_attention"][1], kernel_ab.ctypes.c_int
    _check(kernel_ab.decode_attention_cases({"A": fn, "B": fn}, 2, cases=((3, 40),), layers=2))


def test_an_unknown_revision_is_refused(tmp_path):
    with pytest.raises(subprocess.CalledProcessError):
        kernel_ab.build("paged_attention", "no-such-revision", tmp_path)


def test_the_rope_cases_run_the_fused_library_with_its_signature():
    if not available("fused"):
        pytest.skip("the fused kernels do not build here")
    fn = library("fused").pd_rope_write_kv
    fn.argtypes, fn.restype = kernel_ab.SIGNATURES["rope_write_kv"][1], None
    rows = kernel_ab.rope_write_kv_cases({"A": fn, "B": fn}, 1, rows=(40, 3), layers=2)
    _check(rows)
    assert [r["case"].split(",")[1].strip() for r in rows] == ["2 layers of 40 rows", "2 layers of 3 rows"]
