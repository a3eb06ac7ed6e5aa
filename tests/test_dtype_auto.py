"""``--dtype auto``: resolved once, in the worker, from the checkpoint's ``torch_dtype``, the device and the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pdserve.cluster import compute
from pdserve.cluster.compute import checkpoint_dtype, resolve_dtype
from pdserve.cluster.worker_config import WorkerConfig
from pdserve.deploy import cluster_args
from pdserve.kernels.cpu import available


def _checkpoint(tmp_path: Path, torch_dtype: str | None, key: str = "torch_dtype") -> Path:
    cfg = {"model_type": "llama", "hidden_size": 8}
    if torch_dtype is not None:
        cfg[key] = torch_dtype
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.fixture(params=[True, False], ids=["bf16_kernels", "no_bf16_kernels"])
def bf16_cpu(request, monkeypatch) -> bool:
    monkeypatch.setattr(compute, "cpu_serves_bf16", lambda: request.param)
    return request.param


def test_auto_on_fp32_checkpoint_is_bf16_iff_the_cpu_runs_the_packed_bf16_kernels(tmp_path, bf16_cpu):
    model = _checkpoint(tmp_path, "float32")
    assert resolve_dtype("auto", model) == ("bfloat16" if bf16_cpu else "float32")
    cfg = WorkerConfig(model_dir=str(model), worker_id="w", dtype="auto", device="cpu")  # a GPU serves bf16
    assert cfg.torch_dtype is (torch.bfloat16 if bf16_cpu else torch.float32)


def test_auto_without_a_torch_dtype_reads_as_fp32(tmp_path, bf16_cpu):
    assert resolve_dtype("auto", _checkpoint(tmp_path, None)) == ("bfloat16" if bf16_cpu else "float32")


@pytest.mark.parametrize("stored", ["bfloat16", "float16"])
def test_auto_keeps_a_16_bit_checkpoint_dtype(tmp_path, bf16_cpu, stored):
    assert resolve_dtype("auto", _checkpoint(tmp_path, stored)) == stored


def test_auto_reads_the_newer_dtype_key(tmp_path, bf16_cpu):
    assert resolve_dtype("auto", _checkpoint(tmp_path, "float16", key="dtype")) == "float16"


@pytest.mark.parametrize("explicit", ["float32", "bfloat16", "float16"])
def test_explicit_dtype_wins(tmp_path, bf16_cpu, explicit):
    for stored in ("float32", "bfloat16", "float16"):
        model = _checkpoint(tmp_path, stored)
        assert resolve_dtype(explicit, model) == explicit
        assert WorkerConfig(model_dir=str(model), worker_id="w", dtype=explicit).resolved_dtype == explicit


def test_unknown_checkpoint_dtype_is_refused_naming_the_field(tmp_path):
    model = _checkpoint(tmp_path, "float8_e4m3fn")
    with pytest.raises(ValueError, match="torch_dtype 'float8_e4m3fn'"):
        resolve_dtype("auto", model)
    with pytest.raises(ValueError, match="torch_dtype"):
        checkpoint_dtype(model)
    assert resolve_dtype("float32", model) == "float32"  # an explicit dtype needs no field


def test_unknown_dtype_name_is_refused(tmp_path):
    with pytest.raises(ValueError, match="dtype must be auto or one of"):
        WorkerConfig(model_dir=str(tmp_path), worker_id="w", dtype="fp8")
    with pytest.raises(ValueError, match="dtype must be auto"):
        resolve_dtype("half", tmp_path)


def test_worker_config_default_stays_float32_and_pdserve_up_defaults_to_auto(tmp_path):
    assert WorkerConfig(model_dir=str(tmp_path), worker_id="w").dtype == "float32"
    import argparse

    parser = argparse.ArgumentParser()
    cluster_args.add_cluster_args(parser)
    assert parser.parse_args([]).dtype == "auto"
    assert parser.parse_args(["--dtype", "float32"]).dtype == "float32"


def test_every_avx2_or_avx512_cpu_with_a_compiler_serves_bf16():
    """The FMA GEMMs need only AVX-512F/BW, or AVX2 and FMA: a CPU that has either serves an fp32
    checkpoint in bf16 whether or not it has AVX512-BF16 (on an AVX2-only Zen 3 core bf16 decode ran
    2.2x fp32's, docs/benchmarks.md); a CPU with neither keeps float32."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        pytest.skip("no /proc/cpuinfo flags here")
    isa = set(flags.split())
    fma_gemm = {"avx512f", "avx512bw"} <= isa or {"avx2", "fma"} <= isa
    if fma_gemm and not (available("gemm_bf16_fma") or available("gemm_bf16_avx2")):
        pytest.skip("no C compiler, or the C kernels turned off (PDSERVE_CPU_KERNELS=torch)")
    assert compute.cpu_serves_bf16() == fma_gemm


def test_auto_serves_an_fp32_checkpoint_in_bf16_on_a_gpu(tmp_path, bf16_cpu):
    """vLLM's ``--dtype auto`` on GPUs: fp32 checkpoints in bf16, whatever the CPU has (the device is
    named, not asked: no GPU is needed to resolve it)."""
    model = _checkpoint(tmp_path, "float32")
    assert resolve_dtype("auto", model, torch.device("cuda", 0)) == "bfloat16"
    assert resolve_dtype("auto", model, "cpu") == ("bfloat16" if bf16_cpu else "float32")
    assert resolve_dtype("float32", model, "cuda") == "float32"
