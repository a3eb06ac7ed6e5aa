"""Fused RMSNorm (with the residual add before it), RoPE + KV cache write and SiLU-and-mul on CPUs (``fused.c``).

Inputs are float32 or bf16 row-major ``[rows, features]`` CPU tensors; the model calls these
when the step's metadata says so (:func:`kernels.paged_attention.cpu_kernels_apply`: decode-sized
steps), and for bf16 prefill rows of any count where they run on AVX-512 (:func:`vectorized`).

Each replaces a chain of small tensor operations whose framework overhead, at a few rows,
outweighs their arithmetic (Qwen3's per-head q/k RMSNorm runs inside :func:`rope_write_kv`).
Results follow the torch code in :mod:`model.llama` and
:mod:`model.rope` rounding for rounding (float32 up to the order of the RMS sum).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from pdserve.kernels.cpu import DTYPES, available, library

_i64, _p, _int, _f = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
MAX_ROWS = 64   # decode-sized: beyond this torch's vectorized operations win (used by cpu_kernels_apply)
MAX_HEAD_DIM = 512   # rope_write_kv's per-head buffers


def _check_rows(name: str, x: torch.Tensor) -> None:
    if x.dtype not in DTYPES or x.dim() != 2 or x.device.type != "cpu" or x.stride(1) != 1:
        raise ValueError(f"{name}: needs a row-major 2-D float32/bf16 CPU tensor, got {x.dtype} {tuple(x.shape)} "
                         f"strides {x.stride()}")


@functools.cache
def vectorized() -> bool:
    """Whether these kernels run on AVX-512 here, and so beat torch's operators at every row count;
    the scalar build serves decode-sized steps only. bench-80m's layer at 512 bf16 rows, Xeon model 167
    (AMX, AVX512-BF16), one core: RMSNorm C ~0.05 ms vs torch's chain of seven operations ~0.2 ms;
    RoPE with the KV write 0.17 vs 0.82 ms; SiLU-and-mul 0.50 vs 0.78 ms (``bench/cpu_kernels.py``, part 5)."""
    return available("fused") and bool(library("fused").pd_vectorized())


def silu_path() -> str:
    """The path :func:`silu_and_mul` takes for bf16 rows here, recorded by the benchmarks: ``"lookup"`` (each
    gate's silu read from a table of all 65,536 bf16 values that the arithmetic filled, bit-identical to it),
    ``"arithmetic"`` (the exponential and the division on 16 lanes; chosen where it timed faster at the
    process's first call, ``kernels/cpu/silu_mul.h``), or ``"scalar"`` off AVX-512."""
    if not vectorized():
        return "scalar"
    return "lookup" if _fn("pd_silu_lookup", [], _int)() else "arithmetic"


def set_silu_path(path: str) -> None:
    """Make bf16 rows take ``path`` (``"lookup"`` or ``"arithmetic"``) from now on in this process, in place of
    the timed choice: for tests and benchmarks of either path.

    Raises:
        ValueError: another path name, or a build without the vectorized kernels.
    """
    if path not in ("lookup", "arithmetic") or not vectorized():
        raise ValueError(f"set_silu_path: {path!r} is not a path of this build ({silu_path()!r} runs here)")
    _fn("pd_silu_use_lookup", [_int])(int(path == "lookup"))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x))`` per row; ``x`` ``[rows, dim]``, ``weight`` ``[dim]`` of x's dtype.

    Raises:
        ValueError: layouts or dtypes the kernel does not take.
    """
    _check_rows("rms_norm", x)
    if weight.dtype != x.dtype or weight.shape != (x.shape[1],) or not weight.is_contiguous():
        raise ValueError(f"rms_norm: weight must be [{x.shape[1]}] {x.dtype}, got {tuple(weight.shape)} {weight.dtype}")
    out = torch.empty(x.shape, dtype=x.dtype)
    _fn("pd_rms_norm", [_p, _p, _p, _i64, _i64, _i64, _i64, _f, _int])(
        x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], x.stride(0), x.shape[1],
        eps, int(x.dtype == torch.bfloat16))
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` (rounded to their dtype, as torch's add) and ``weight * (s / rms(s))`` in one pass
    over the rows: a decoder layer's residual add and the next RMSNorm (vLLM's ``fused_add_rms_norm``).
    ``x``, ``residual`` ``[rows, dim]`` of one dtype, ``weight`` ``[dim]``. Returns ``(normed, s)``, each
    ``[rows, dim]``; ``normed`` as :func:`rms_norm` of ``s``, bit-identical.

    Raises:
        ValueError: layouts, shapes or dtypes the kernel does not take.
    """
    _check_rows("add_rms_norm", x)
    _check_rows("add_rms_norm", residual)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)} {residual.dtype} does not match "
                         f"x {tuple(x.shape)} {x.dtype}")
    if weight.dtype != x.dtype or weight.shape != (x.shape[1],) or not weight.is_contiguous():
        raise ValueError(f"add_rms_norm: weight must be [{x.shape[1]}] {x.dtype}, got {tuple(weight.shape)} "
                         f"{weight.dtype}")
    s, out = torch.empty(x.shape, dtype=x.dtype), torch.empty(x.shape, dtype=x.dtype)
    _fn("pd_add_rms_norm", [_p, _p, _p, _p, _p, _i64, _i64, _i64, _i64, _i64, _i64, _f, _int])(
        x.data_ptr(), residual.data_ptr(), weight.data_ptr(), s.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1],
        x.stride(0), residual.stride(0), x.shape[1], x.shape[1], eps, int(x.dtype == torch.bfloat16))
    return out, s


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                  slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                  q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                  eps: float = 1e-6, q_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """RoPE on the queries and keys of ``qkv`` (``[n, (H + 2 Hkv) D]``, as ``qkv_proj`` returns it);
    rotated keys and the values go to ``kv_cache`` (of qkv's dtype) at ``slot_mapping`` (``[n]`` int64).
    ``cos``/``sin``: ``[n, 1, D]`` or ``[n, D]`` float32. Returns the rotated queries ``[n, H, D]`` float32.
    ``q_norm``, ``k_norm`` (``[D]`` of qkv's dtype, both or neither): each query / key head is first
    RMS-normalized with ``eps`` and scaled by them, as :class:`model.llama.RMSNorm` over the head
    (Qwen3). ``q_dtype``: float32 (for the decode attention) or qkv's dtype (for the prefill attention,
    :func:`~kernels.cpu.attention.prefill_attention_cpu`); the values are the same, rounded to qkv's
    dtype as ``apply_rotary`` rounds them. Slots must lie inside the cache (not checked; the engine
    allocates them from its pool).

    Raises:
        ValueError: an odd ``head_dim`` or one above 512, or shapes, dtypes and layouts that do not
            fit each other (the cache and norm weights must have qkv's dtype and head layout, the
            slots be int64).
    """
    n = qkv.shape[0]
    _check_rows("rope_write_kv", qkv)
    if head_dim > MAX_HEAD_DIM or head_dim % 2:
        raise ValueError(f"rope_write_kv: head_dim must be even and at most {MAX_HEAD_DIM}, got {head_dim}")
    if (kv_cache.dtype != qkv.dtype or not kv_cache.is_contiguous() or kv_cache.shape[4:] != (num_kv_heads, head_dim)
            or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim):
        raise ValueError(f"rope_write_kv: qkv {tuple(qkv.shape)} {qkv.dtype} does not fit the cache "
                         f"{tuple(kv_cache.shape)} {kv_cache.dtype} with {num_heads}/{num_kv_heads} heads of "
                         f"{head_dim}")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (n,):
        raise ValueError(f"rope_write_kv: slot_mapping must be [{n}] int64, got {tuple(slot_mapping.shape)} "
                         f"{slot_mapping.dtype}")
    if (q_norm is None) != (k_norm is None) or any(
            w is not None and (w.dtype != qkv.dtype or w.shape != (head_dim,) or not w.is_contiguous())
            for w in (q_norm, k_norm)):
        raise ValueError(f"rope_write_kv: q_norm and k_norm must both be contiguous [{head_dim}] {qkv.dtype} "
                         f"or both None")
    if q_dtype not in (torch.float32, qkv.dtype):
        raise ValueError(f"rope_write_kv: q_dtype must be float32 or qkv's {qkv.dtype}, got {q_dtype}")
    cos, sin = cos.reshape(n, head_dim).contiguous(), sin.reshape(n, head_dim).contiguous()
    slots = slot_mapping.contiguous()
    norms = (q_norm.data_ptr(), k_norm.data_ptr()) if q_norm is not None else (None, None)
    q = torch.empty(n, num_heads, head_dim, dtype=q_dtype)
    s_block, _, s_kv, s_tok, s_head, _ = kv_cache.stride()
    base = kv_cache.data_ptr() + layer * kv_cache.stride(1) * kv_cache.element_size()
    _fn("pd_rope_write_kv", [_p, _i64, _i64, _i64, _i64, _i64, _p, _p, _p, _int, _p, _i64, _i64, _i64, _i64, _p,
                             _i64, _int, _p, _p, _f])(
        qkv.data_ptr(), n, qkv.stride(0), num_heads, num_kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(),
        q.data_ptr(), int(q_dtype != torch.float32), base, s_block, s_tok, s_head, s_kv, slots.data_ptr(),
        kv_cache.shape[3], int(qkv.dtype == torch.bfloat16), *norms, eps)
    return q


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` ``[rows, 2 I]`` (gate first) -> ``[rows, I]``, written into ``out``
    where given (``[rows, I]`` of ``gate_up``'s dtype with unit column stride, e.g. a column slice of a wider
    tensor: :class:`model.onednn_linear.OneDNNGateUp` fills its slices piece by piece).

    Raises:
        ValueError: layouts or dtypes the kernel does not take, or an ``out`` that does not match.
    """
    _check_rows("silu_and_mul", gate_up)
    inter = gate_up.shape[1] // 2
    if out is None:
        out = torch.empty(gate_up.shape[0], inter, dtype=gate_up.dtype)
    elif out.dtype != gate_up.dtype or out.shape != (gate_up.shape[0], inter) or out.device.type != "cpu" \
            or out.stride(1) != 1:
        raise ValueError(f"silu_and_mul: out must be {gate_up.dtype} [{gate_up.shape[0]}, {inter}] with unit "
                         f"column stride, got {out.dtype} {tuple(out.shape)} strides {out.stride()}")
    _fn("pd_silu_mul_to", [_p, _i64, _i64, _i64, _p, _i64, _int])(
        gate_up.data_ptr(), gate_up.shape[0], inter, gate_up.stride(0), out.data_ptr(), out.stride(0),
        int(gate_up.dtype == torch.bfloat16))
    return out


def silu_mul_address() -> int:
    """The address of the C SiLU-and-mul behind :func:`silu_and_mul` (``pd_silu_mul_to``), for a kernel of another
    library that runs it beside its own work (:func:`kernels.cpu.gemv.amx_gate_up_silu`); its path chosen first."""
    silu_path()
    return ctypes.cast(library("fused").pd_silu_mul_to, ctypes.c_void_p).value


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for float32 ``[rows, vocab]`` row-major CPU logits -> int64 ``[rows]``:
    the same index as torch's (the first NaN of a row, else its first maximum), in two vector passes
    over each row where torch's reduction runs ~3 cycles an element (batch 32 x 2,048 entries, Zen 4:
    58 us in torch).

    Raises:
        ValueError: a tensor of another dtype, rank, device or layout, or an empty vocabulary.
    """
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.device.type != "cpu" \
            or logits.stride(1) != 1 or logits.shape[1] == 0:
        raise ValueError(f"argmax_rows: needs row-major float32 [rows, vocab > 0] CPU logits, got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    _fn("pd_argmax_rows", [_p, _i64, _i64, _i64, _p])(
        logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0), out.data_ptr())
    return out


def mask_logits_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set to -inf, in place, every entry of float32 ``[vocab]`` contiguous CPU ``logits`` whose bit in
    ``bitmask`` (int32 ``[ceil(vocab / 32)]``, bit ``j % 32`` of word ``j // 32``: xgrammar's token bitmask)
    is clear; returns ``logits``. One masked store per 16 tokens on AVX-512, where xgrammar's CPU path takes
    ~0.5 ms for a 128,256-token vocabulary (Zen 4).

    Raises:
        ValueError: tensors of another dtype, shape, device or layout.
    """
    vocab = logits.shape[0] if logits.dim() == 1 else -1
    if logits.dtype != torch.float32 or logits.dim() != 1 or logits.device.type != "cpu" or not logits.is_contiguous() \
            or bitmask.dtype != torch.int32 or not bitmask.is_contiguous() or bitmask.numel() * 32 < vocab:
        raise ValueError(f"mask_logits_: needs contiguous float32 [vocab] CPU logits and an int32 bitmask of "
                         f"ceil(vocab / 32) words, got {logits.dtype} {tuple(logits.shape)} and {bitmask.dtype} "
                         f"{tuple(bitmask.shape)}")
    _fn("pd_mask_logits", [_p, _p, _i64])(logits.data_ptr(), bitmask.data_ptr(), vocab)
    return logits


def _fn(name: str, argtypes: list, restype=None):
    fn = getattr(library("fused"), name)
    if fn.argtypes is None:
        fn.argtypes, fn.restype = argtypes, restype
    return fn
