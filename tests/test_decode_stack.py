"""The one-call decode stack (kernels/cpu/decode_stack.c, model/cpu_stack.py) against the
per-operation C-kernel path it replaces: bit-identical hidden states for every family option
(biases, q/k norm, GQA, odd head sizes), bf16-packed and INT4 projections, bf16 and float32
activations, decode and short multi-token steps, the self-draft's first layers; the stack is
rebuilt when weights move and refused where a projection cannot run on it."""

from __future__ import annotations

import copy

import pytest
import torch

from pdserve.kernels.cpu import available
from pdserve.kernels.cpu.decode_stack import DecodeStack, stack_available
from pdserve.kernels.paged_attention import build_attention_metadata
from pdserve.model import cpu_stack
from pdserve.model.cpu_linear import pack_for_cpu_decode
from pdserve.model.hugepages import move_to_huge_pages
from pdserve.model.kv_cache import KVCacheSpec
from pdserve.model.llama import LlamaForCausalLM
from pdserve.model.loader import load_model
from pdserve.model.quant import int4
from tests.family_checkpoints import write_checkpoint

needs_stack = pytest.mark.skipif(not stack_available(bf16_packed=True), reason="no C compiler or no AVX2")
needs_int4 = pytest.mark.skipif(not stack_available(int4=True, bf16_packed=True),
                                reason="no C compiler or no AVX512-VNNI")
# family, checkpoint overrides: every option of the decoder the stack must carry
VARIANTS = {"llama-biases": ("llama", dict(attention_bias=True, mlp_bias=True)), "qwen2": ("qwen2", {}),
            "qwen3": ("qwen3", {}), "mistral": ("mistral", {})}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return {name: write_checkpoint(family, tmp_path_factory.mktemp(name), **over)
            for name, (family, over) in VARIANTS.items()}


def _model(path: str, weights: str) -> tuple[LlamaForCausalLM, object]:
    dtype = torch.float32 if weights == "int4-fp32" else torch.bfloat16
    model, cfg = load_model(path, dtype)
    if weights == "bf16":
        pack_for_cpu_decode(model)
    else:
        int4.convert_for_runtime(model, group_size=32, method="rtn")
    return model, cfg


def _steps(model: LlamaForCausalLM, cfg, num_layers: int | None = None) -> list[torch.Tensor]:
    """Hidden states of: prefill chunks of 5 and 3 tokens on 3 sequences through the C kernels
    (rows <= 64), then 3 decode steps, then a 4-token verify-sized step, on one cache."""
    spec = KVCacheSpec(32, cfg.num_layers, 4, cfg.num_kv_heads, cfg.head_dim, model.norm.weight.dtype)
    cache = spec.allocate("cpu")
    seqs = [[(11 * s + 7 * i) % 990 + 3 for i in range(8 + s)] for s in range(3)]
    tables = [list(range(8 * s, 8 * s + 8)) for s in range(3)]
    done = [0, 0, 0]
    out = []

    def step(chunks: list[list[int]]) -> None:
        meta = build_attention_metadata([len(c) for c in chunks], [d + len(c) for d, c in zip(done, chunks)],
                                        tables, spec.block_size, "cpu", cache.dtype)
        assert meta.cpu_kernels
        out.append(model(torch.tensor([t for c in chunks for t in c]), meta, cache, num_layers).clone())
        for i, c in enumerate(chunks):
            done[i] += len(c)

    step([s[:5] for s in seqs])
    step([s[5:8] for s in seqs])
    for k in range(3):
        step([[(13 * k + i) % 990 + 3] for i in range(3)])
    step([[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]])
    return out


@needs_stack
@pytest.mark.parametrize("weights", ["bf16", pytest.param("int4", marks=needs_int4),
                                     pytest.param("int4-fp32", marks=needs_int4)])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_stack_is_bit_identical_to_the_per_operation_path(variant, weights, checkpoints):
    model, cfg = _model(checkpoints[variant], weights)
    assert cpu_stack.decode_stack(model) is not None
    per_op = copy.deepcopy(model)
    per_op.cpu_stack = False
    for num_layers in (None, 1):
        got, want = _steps(model, cfg, num_layers), _steps(per_op, cfg, num_layers)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and torch.equal(g, w)
    assert per_op not in cpu_stack._STACKS                 # the per-operation path never built one


@needs_stack
def test_moved_weights_rebuild_the_stack(checkpoints):
    model, cfg = _model(checkpoints["qwen2"], "bf16")
    first = cpu_stack.decode_stack(model)
    assert first is not None and cpu_stack.decode_stack(model) is first
    want = _steps(model, cfg)
    move_to_huge_pages(model)                      # new storages for every weight
    assert not first.valid()
    second = cpu_stack.decode_stack(model)
    assert second is not first and second.valid()
    assert all(torch.equal(g, w) for g, w in zip(_steps(model, cfg), want))


@needs_int4
def test_projections_the_stack_cannot_take_keep_the_per_operation_path(checkpoints):
    model, cfg = load_model(checkpoints["llama-biases"], torch.bfloat16)
    assert cpu_stack.decode_stack(model) is None          # plain nn.Linear
    assert pack_for_cpu_decode(model) > 0
    assert cpu_stack.decode_stack(model) is not None      # looked at again once the projections change
    q4, _ = _model(checkpoints["qwen3"], "int4")
    stack = cpu_stack.decode_stack(q4)
    assert stack is not None
    q4.layers[1].mlp.down_proj.exact_cpu = True           # torch's kernel for this one: no stack
    try:
        assert cpu_stack.decode_stack(q4) is None
    finally:
        q4.layers[1].mlp.down_proj.exact_cpu = False


@needs_stack
def test_run_refuses_inputs_that_do_not_fit(checkpoints):
    model, cfg = _model(checkpoints["mistral"], "bf16")
    stack = cpu_stack.decode_stack(model)
    spec = KVCacheSpec(8, cfg.num_layers, 4, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    cache = spec.allocate("cpu")
    meta = build_attention_metadata([1], [1], [[0]], 4, "cpu", cache.dtype)
    cos, sin = model.rotary.cos_sin(meta.positions)
    x = torch.zeros(1, cfg.hidden_size, dtype=torch.bfloat16)
    args = (cos, sin, cache, meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables)
    with pytest.raises(ValueError, match="does not fit"):
        stack.run(x.float(), *args)
    with pytest.raises(ValueError, match="does not fit"):
        stack.run(x, *args, num_layers=cfg.num_layers + 1)
    with pytest.raises(ValueError, match="int32"):
        stack.run(x, cos, sin, cache, meta.slot_mapping, meta.query_start_loc.long(), meta.seq_lens,
                  meta.block_tables)
    with pytest.raises(ValueError, match="at least one layer"):
        DecodeStack([], model.norm.weight, 4, 2, 36, 120, 1e-5, 0.1, torch.bfloat16)


@pytest.fixture
def without_avx512_bf16(monkeypatch):
    """This process as on an AVX-512 CPU without AVX512-BF16 (no gemv, no AMX): the FMA gemm serves."""
    from pdserve.kernels.cpu import decode_stack, gemv
    monkeypatch.setattr(gemv, "gemv_available", lambda: False)
    monkeypatch.setattr(decode_stack, "gemv_available", lambda: False)
    monkeypatch.delenv(gemv.GEMM_ENV, raising=False)
    gemv.bf16_gemm_kernel.cache_clear()
    yield
    gemv.bf16_gemm_kernel.cache_clear()


@pytest.mark.skipif(not (stack_available() and available("gemm_bf16_fma")), reason="no C compiler or no AVX-512")
def test_without_avx512_bf16_the_fma_gemm_serves_every_row_count(without_avx512_bf16, checkpoints):
    """An AVX-512 CPU without AVX512-BF16 (Ice Lake, or a VM hiding it) packs its bf16 projections for
    the float32-FMA gemm at every row count, and the stack runs it without the gemv and AMX symbols,
    bit-identical to the per-operation path; a spec asking for the gemv is refused, not called."""
    from pdserve.kernels.cpu.decode_stack import LinearSpec
    from pdserve.model.cpu_linear import PackedBF16Linear
    model, cfg = _model(checkpoints["qwen3"], "bf16")
    packed = [m for m in model.modules() if isinstance(m, PackedBF16Linear)]
    assert len(packed) == 4 * cfg.num_layers + 1
    assert {m.kernel_for(r) for m in packed for r in (1, 2, 32, 4096)} == {"gemm-fma"}
    stack = cpu_stack.decode_stack(model)
    assert stack is not None and not stack._model.k.gemv_bf16 and not stack._model.k.gemm_amx
    per_op = copy.deepcopy(model)
    per_op.cpu_stack = False
    assert all(torch.equal(g, w) for g, w in zip(_steps(model, cfg), _steps(per_op, cfg)))
    head = model.lm_head
    spec = LinearSpec("bf16", head.packed, head.out_features, head.in_features, gemv_max_rows=1)
    with pytest.raises(ValueError, match="gemv or AMX"):
        stack.linear_struct(spec, (head.out_features, head.in_features), "lm_head")


def test_without_avx512_bf16_forcing_the_dot_product_gemm_keeps_the_fma_gemm(without_avx512_bf16, monkeypatch):
    from pdserve.kernels.cpu import gemv
    monkeypatch.setenv(gemv.GEMM_ENV, "dpbf16")
    gemv.bf16_gemm_kernel.cache_clear()
    fma = "gemm-fma" if available("gemm_bf16_fma") else "gemm-avx2"       # AVX-512, else AVX2 FMAs
    assert gemv.bf16_gemm_kernel() == fma
    assert gemv.packed_bf16_available() == available(gemv.SYMBOLS[fma][0])
