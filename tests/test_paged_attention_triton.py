"""Triton paged-attention decode kernel vs its torch reference, and the reference vs naive attention.

The kernel runs on CPU under the Triton interpreter. Whether ``triton.jit`` builds an interpreted
kernel is decided when the kernel module is imported, and pytest may have imported triton earlier
for another test module, so the kernel comparisons run in ONE subprocess (this file executed as
``python -m tests.test_paged_attention_triton OUT.json`` with TRITON_INTERPRET=1), independent of
import order; each case is then reported by its own test here.
"""

import os

if __name__ == "__main__":  # the worker subprocess: before triton is imported. Never in pytest's process,
    os.environ["TRITON_INTERPRET"] = "1"  # where it would turn every later test's Triton kernel interpreted

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from pdserve.kernels.paged_attention_triton import (  # noqa: E402
    _kernel_is_interpreted,
    paged_attention_decode_reference,
    paged_attention_decode_triton,
)

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Case:
    name: str
    head_dim: int
    num_heads: int
    num_kv_heads: int
    block_size: int
    ctx: tuple[int, ...]          # seq_lens of the batch (new token included)
    dtype: torch.dtype
    q_view: bool = False          # q is a non-contiguous view
    nan_fill: bool = False        # every cache slot outside the contexts (and layer 0) is NaN
    q_mult: float = 1.0           # > 1: peaked softmax, logits far beyond exp's float32 range
    num_splits: int | None = None  # context splits (None: the kernel's choice, 1-2 programs' worth here)


F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
CASES = [
    Case("d24-kv1-h4-bs5-f32", 24, 4, 1, 5, (1, 7, 10, 33), F32),
    Case("d64-kv2-h6-bs16-f32", 64, 6, 2, 16, (1, 7, 16, 33), F32),
    Case("d24-kv2-h4-bs4-bf16", 24, 4, 2, 4, (1, 7, 16, 33), BF16),
    Case("d64-kv1-h5-bs5-bf16", 64, 5, 1, 5, (33, 1, 10, 7), BF16),
    Case("d64-kv2-h4-bs16-f16-qview", 64, 4, 2, 16, (16, 33, 1, 7), F16, q_view=True),
    Case("d24-kv2-h2-bs4-mha-f32", 24, 2, 2, 4, (7, 16, 1, 33), F32),
    Case("d64-kv1-h6-bs16-f32-large-logits", 64, 6, 1, 16, (1, 7, 16, 33), F32, q_mult=40.0),
    Case("d24-kv2-h6-bs5-f32-nan-padding", 24, 6, 2, 5, (1, 7, 10, 33), F32, nan_fill=True),
    Case("d64-kv1-h4-bs16-bf16-nan-padding", 64, 4, 1, 16, (33, 1, 16, 7), BF16, nan_fill=True),
    # flash-decoding splits: one pass; splits left empty by short contexts; the most splits allowed
    Case("d64-kv2-h6-bs16-f32-one-split", 64, 6, 2, 16, (1, 7, 16, 33), F32, num_splits=1),
    Case("d24-kv1-h4-bs5-f32-3-splits", 24, 4, 1, 5, (1, 7, 10, 33), F32, num_splits=3),
    Case("d64-kv2-h4-bs16-bf16-64-splits", 64, 4, 2, 16, (16, 33, 1, 70), BF16, num_splits=64),
    Case("d64-kv1-h6-bs16-f32-large-logits-5-splits", 64, 6, 1, 16, (1, 7, 16, 33), F32, q_mult=40.0,
         num_splits=5),
    Case("d24-kv2-h6-bs5-f32-nan-padding-4-splits", 24, 6, 2, 5, (1, 7, 10, 33), F32, nan_fill=True,
         num_splits=4),
]
TOL = {F32: dict(rtol=2e-5, atol=2e-5), BF16: dict(rtol=1.6e-2, atol=1e-2), F16: dict(rtol=2e-3, atol=2e-3)}


def make_inputs(case: Case, seed: int = 0) -> dict:
    """Deterministic inputs: per-sequence K/V written into layer 1 of a 2-layer cache through a
    scattered block table; padding entries are 0, a spare block never used by any sequence."""
    g = torch.Generator().manual_seed(seed)
    bs, hkv, d = case.block_size, case.num_kv_heads, case.head_dim
    n_blocks = [-(-n // bs) for n in case.ctx]
    num_blocks = sum(n_blocks) + 3                                   # 3 spare blocks
    ids = torch.randperm(num_blocks, generator=g)                    # scattered, non-contiguous ids
    ids = torch.cat([ids[ids != 0], ids[ids == 0]])                  # block 0 spare: padding id, NaN if nan_fill
    shape = (num_blocks, 2, 2, bs, hkv, d)
    fill = torch.full(shape, float("nan")) if case.nan_fill else torch.randn(shape, generator=g)
    kv_cache = fill.to(case.dtype)
    block_tables = torch.zeros(len(case.ctx), max(n_blocks) + 1, dtype=torch.int32)
    ks, vs, used = [], [], 0
    for b, n in enumerate(case.ctx):
        table = ids[used: used + n_blocks[b]]
        used += n_blocks[b]
        block_tables[b, : len(table)] = table.int()
        k = torch.randn(n, hkv, d, generator=g).to(case.dtype)
        v = torch.randn(n, hkv, d, generator=g).to(case.dtype)
        pos = torch.arange(n)
        kv_cache[table[pos // bs], 1, 0, pos % bs] = k
        kv_cache[table[pos // bs], 1, 1, pos % bs] = v
        ks.append(k)
        vs.append(v)
    q = (torch.randn(len(case.ctx), case.num_heads, 2 * d, generator=g) * case.q_mult).to(case.dtype)
    q = q[..., :d] if case.q_view else q[..., :d].contiguous()
    assert q.is_contiguous() != case.q_view
    return dict(q=q, kv_cache=kv_cache, layer=1, block_tables=block_tables,
                seq_lens=torch.tensor(case.ctx, dtype=torch.int32), scale=d ** -0.5, ks=ks, vs=vs)


def kernel_args(inp: dict) -> tuple:
    return tuple(inp[k] for k in ("q", "kv_cache", "layer", "block_tables", "seq_lens", "scale"))


def naive_attention(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], scale: float) -> torch.Tensor:
    """Full attention of each sequence's query over its own K/V (no cache, no block table), float64."""
    outs = []
    for b, (k, v) in enumerate(zip(ks, vs)):
        group = q.shape[1] // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1)               # [L, H, D]
        v = v.double().repeat_interleave(group, dim=1)
        w = torch.softmax((q[b].double()[None] * k).sum(-1) * scale, dim=0)   # [L, H] over context
        outs.append((w[..., None] * v).sum(0))                       # [H, D]
    return torch.stack(outs)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_reference_matches_naive_attention(case: Case):
    inp = make_inputs(case)
    ref = paged_attention_decode_reference(*kernel_args(inp))
    assert ref.dtype == case.dtype and ref.shape == inp["q"].shape
    assert torch.isfinite(ref).all()
    naive = naive_attention(inp["q"], inp["ks"], inp["vs"], inp["scale"])
    torch.testing.assert_close(ref.float(), naive.float(), **TOL[case.dtype])


def _kernel_case_error(case: Case) -> str:
    """Run the kernel on ``case``; '' when it matches the reference, else the failure message."""
    inp = make_inputs(case)
    try:
        out = paged_attention_decode_triton(*kernel_args(inp), num_splits=case.num_splits)
        ref = paged_attention_decode_reference(*kernel_args(inp))
        assert out.dtype == case.dtype and out.shape == inp["q"].shape, (out.dtype, out.shape)
        assert torch.isfinite(out).all(), "non-finite output: a padding/unused slot was read"
        torch.testing.assert_close(out, ref, **TOL[case.dtype])
    except Exception as e:  # reported per case by the parent test
        return f"{type(e).__name__}: {e}"
    return ""


@pytest.fixture(scope="module")
def kernel_results(tmp_path_factory) -> dict[str, str]:
    """Run every kernel case in one interpreter subprocess; {case name: '' or error message}."""
    out = tmp_path_factory.mktemp("pa-triton") / "results.json"
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "tests.test_paged_attention_triton", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"kernel worker failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_triton_kernel_matches_reference(case: Case, kernel_results: dict[str, str]):
    assert kernel_results[case.name] == "", kernel_results[case.name]


def _good_args() -> list:
    return list(kernel_args(make_inputs(CASES[1])))   # B=4, H=6, H_kv=2, D=64, 2 layers


@pytest.mark.parametrize("index, bad, match", [
    (0, torch.zeros(4, 6, 32), "head_dim mismatch"),
    (0, torch.zeros(4, 5, 64), "multiple of num_kv_heads"),
    (0, torch.zeros(4, 6), "q must be"),
    (1, torch.zeros(8, 2, 2, 16, 2), "kv_cache must be"),
    (2, 2, "layer 2 out of range"),
    (3, torch.zeros(3, 4, dtype=torch.int32), "block_tables must be"),
    (4, torch.ones(5, dtype=torch.int32), "seq_lens must be"),
    (4, torch.ones(4), "seq_lens must be int32 or int64"),
])
def test_shape_mismatch_raises_value_error(index: int, bad, match: str):
    args = _good_args()
    args[index] = bad
    for fn in (paged_attention_decode_triton, paged_attention_decode_reference):
        with pytest.raises(ValueError, match=match):
            fn(*args)


def test_block_t_must_be_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        paged_attention_decode_triton(*_good_args(), block_t=12)


@pytest.mark.parametrize("num_splits", [0, 65])
def test_num_splits_out_of_range_raises_value_error(num_splits: int):
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention_decode_triton(*_good_args(), num_splits=num_splits)


def test_num_splits_fill_the_gpu_and_stay_in_range(monkeypatch):
    """Enough programs for a 132-multiprocessor GPU at batch 1, none added once the batch fills it,
    never more splits than tiles of context, never more than MAX_SPLITS."""
    from pdserve.kernels import paged_attention_triton as pat
    cuda = torch.device("cuda", 0)
    monkeypatch.setitem(pat._SMS, 0, 132)
    assert pat.num_splits_for(1, 8, 8192, 32, cuda) == 64          # 4 x 132 / 8 = 66, capped
    assert pat.num_splits_for(4, 8, 8192, 32, cuda) == 17          # 528 / 32 programs
    assert pat.num_splits_for(64, 8, 8192, 32, cuda) == 2
    assert pat.num_splits_for(128, 8, 8192, 32, cuda) == 1
    assert pat.num_splits_for(1, 8, 64, 32, cuda) == 2             # 64 tokens: two tiles
    assert pat.num_splits_for(1, 1, 16, 32, torch.device("cpu")) == 1


def test_cpu_without_interpreter_raises_runtime_error():
    code = ("import torch\n"
            "from kernels.paged_attention_triton import paged_attention_decode_triton as f\n"
            "try:\n"
            "    f(torch.zeros(1, 2, 8), torch.zeros(2, 1, 2, 4, 1, 8), 0, torch.zeros(1, 1, dtype=torch.int32),\n"
            "      torch.ones(1, dtype=torch.int32), 1.0)\n"
            "except RuntimeError as e:\n"
            "    print('RAISED', e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "RAISED" in proc.stdout and "CUDA" in proc.stdout and "TRITON_INTERPRET=1" in proc.stdout, proc.stdout


if __name__ == "__main__":  # worker mode for kernel_results
    if not _kernel_is_interpreted():
        sys.exit("triton was imported before TRITON_INTERPRET=1 was set; the kernel is not interpreted")
    Path(sys.argv[1]).write_text(json.dumps({c.name: _kernel_case_error(c) for c in CASES}))
