"""Paged attention on CPUs (``paged_attention.c``, ``prefill_attention.c`` and their AVX2 forms).

Same contract as :func:`kernels.paged_attention.paged_attention_torch` for steps whose new
tokens' K/V are already in the cache, without the torch path's gather of every context
into a padded batch: the kernels walk each sequence's block table once per KV head.
:func:`paged_attention_cpu` serves decode steps and short query blocks (float32 or bf16 cache; on
AVX-512, on AVX2 for bf16 caches, else a portable C path);
:func:`prefill_attention_cpu` serves prefill chunks of any length over a bf16 cache, about 4x
torch's CPU flash attention on one AVX-512 core and 1.1-1.6x on an AVX2 one (``bench/cpu_kernels.py``).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

import torch

from pdserve.kernels.cpu import DTYPES, available, library
from pdserve.kernels.cpu.gemv import KERNELS, bf16_gemm_kernel, gemm_amx_available

log = logging.getLogger(__name__)

_i64, _p = ctypes.c_int64, ctypes.c_void_p


def attention_available() -> bool:
    """Whether :func:`paged_attention_cpu` can run here (the C library builds)."""
    return available("paged_attention")


def paged_attention_cpu(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of a flat batch of queries against each sequence's paged context.

    Args:
        q: ``[num_tokens, num_heads, head_dim]`` queries (RoPE applied), any float dtype.
        kv_cache: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` float32 or
            bfloat16 on the CPU, with this step's K/V already written.
        layer: the layer to read.
        query_start_loc: ``[B + 1]`` int32, sequence ``b`` owns rows ``[qsl[b], qsl[b+1])``: its
            last ``qsl[b+1] - qsl[b]`` tokens, causal among themselves.
        seq_lens: ``[B]`` int32 context lengths including the new tokens.
        block_tables: ``[B, max_blocks]`` int32.
        scale: softmax scale.
    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``.

    Contract (not checked, as the torch path's indexing would): block ids are below the cache's
    ``num_blocks`` and each table row covers its ``seq_lens`` entry; the engine's block pool and
    :func:`~kernels.paged_attention.build_attention_metadata` guarantee both.
    Raises:
        ValueError: shapes, dtypes or devices the kernel does not take.
        MemoryError: the kernel's score buffer could not be allocated.
    """
    n, heads, dim = q.shape
    num_kv_heads = kv_cache.shape[4]
    if kv_cache.device.type != "cpu" or kv_cache.dtype not in DTYPES \
            or not kv_cache.is_contiguous():
        raise ValueError("paged_attention_cpu: kv_cache must be a contiguous float32/bfloat16 CPU tensor")
    if heads % num_kv_heads or dim != kv_cache.shape[5]:
        raise ValueError(f"paged_attention_cpu: q {tuple(q.shape)} does not fit the cache {tuple(kv_cache.shape)}")
    _check_int32("paged_attention_cpu", query_start_loc, seq_lens, block_tables)
    qf = q.float().contiguous()
    out = torch.empty_like(qf)
    base, s_block, s_tok, s_head, s_kv = _layer_layout(kv_cache, layer)
    rc = _fn()(qf.data_ptr(), out.data_ptr(), heads, num_kv_heads, dim,
               query_start_loc.data_ptr(), seq_lens.data_ptr(), seq_lens.shape[0],
               base, int(kv_cache.dtype == torch.bfloat16), s_block, s_tok, s_head, s_kv,
               block_tables.data_ptr(), block_tables.shape[1], kv_cache.shape[3], float(scale))
    if rc != 0:
        raise MemoryError("paged_attention_cpu: could not allocate the score buffer")
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def _check_int32(name: str, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                 block_tables: torch.Tensor) -> None:
    for t in (query_start_loc, seq_lens, block_tables):
        if t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"{name}: query_start_loc, seq_lens and block_tables must be contiguous int32")


def _layer_layout(kv_cache: torch.Tensor, layer: int) -> tuple[int, int, int, int, int]:
    """``(address of layer's slice, s_block, s_tok, s_head, s_v)``: the cache as the C kernels walk it
    (strides in elements; V of a row at its K address + ``s_v``)."""
    s_block, s_layer, s_kv, s_tok, s_head, _ = kv_cache.stride()
    return kv_cache.data_ptr() + layer * s_layer * kv_cache.element_size(), s_block, s_tok, s_head, s_kv


def _fn():
    fn = library("paged_attention").pd_paged_attention
    if fn.argtypes is None:
        fn.argtypes = [_p, _p, _i64, _i64, _i64, _p, _p, _i64, _p, ctypes.c_int, _i64, _i64, _i64, _i64,
                       _p, _i64, _i64, ctypes.c_float]
        fn.restype = ctypes.c_int
    return fn


PREFILL_MAX_HEAD_DIM = 256
PREFILL_ENV = "PDSERVE_PREFILL_ATTENTION"


@functools.cache
def prefill_attention_path() -> str:
    """Where bf16 prefill attention runs: ``"amx"`` (``prefill_attention_amx.c``, both products on AMX
    tiles) where AMX is granted, else ``"c"`` (the build that follows the bf16 GEMM, :func:`prefill_library`).
    One layer of bench-80m on an AMX Xeon (model 167, 2026-11-28, ``bench/cpu_kernels.py``): 1.7 ms at 512
    tokens and 18.4 ms at 2,048 on AMX tiles, 2.9 / 27.3 ms in torch's ``scaled_dot_product_attention``
    (oneDNN, AMX too); the FMA build took 4.6 / 68.6 ms. ``PDSERVE_PREFILL_ATTENTION=amx|c|torch`` overrides
    (``torch``: the torch path everywhere; ``amx`` only where AMX is granted, else logged and ignored).

    Raises:
        ValueError: ``PDSERVE_PREFILL_ATTENTION`` is set to something else.
    """
    forced = os.environ.get(PREFILL_ENV, "").lower()
    if forced not in ("", "amx", "c", "torch"):
        raise ValueError(f"{PREFILL_ENV} must be 'amx', 'c' or 'torch', got {forced!r}")
    amx = gemm_amx_available() and available(_AMX_BUILD)
    if forced == "amx" and not amx:
        log.warning("%s=amx ignored: AMX is not granted here", PREFILL_ENV)
    return forced if forced in ("c", "torch") else "amx" if amx else "c"


_AMX_BUILD = "prefill_attention_amx"
_PREFILL_BUILDS = {KERNELS[3]: "prefill_attention_fma", KERNELS[4]: "prefill_attention_avx2"}  # by GEMM


def prefill_library(head_dim: int = 64) -> str:
    """The prefill attention build this CPU runs for heads of ``head_dim``: ``"prefill_attention_amx"``
    where :func:`prefill_attention_path` says AMX and ``head_dim`` is a multiple of 32 (an A tile's
    width); else following the packed bf16 GEMM's choice (:func:`kernels.cpu.gemv.bf16_gemm_kernel`):
    ``"prefill_attention"`` (``vdpbf16ps``), ``"prefill_attention_fma"`` (the same products on float32
    FMAs, where the GEMMs run on FMAs: no AVX512-BF16, or a slow one) or ``"prefill_attention_avx2"``
    (8-lane FMAs, CPUs without AVX-512)."""
    if prefill_attention_path() == "amx" and head_dim % 32 == 0:
        return _AMX_BUILD
    return _PREFILL_BUILDS.get(bf16_gemm_kernel(), "prefill_attention")


def prefill_attention_available(head_dim: int) -> bool:
    """Whether :func:`prefill_attention_cpu` takes this head size here (AVX-512 or AVX2 with FMA,
    ``head_dim`` a multiple of 16 up to :data:`PREFILL_MAX_HEAD_DIM`) and the torch path is not forced
    (:func:`prefill_attention_path`)."""
    return head_dim % 16 == 0 and head_dim <= PREFILL_MAX_HEAD_DIM and prefill_attention_path() != "torch" \
        and available(prefill_library(head_dim))


def prefill_attention_cpu(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, query_start_loc: torch.Tensor,
                          seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of every sequence's new tokens over its paged context (earlier chunks and
    these tokens), for bf16 queries and a bf16 cache; arguments as :func:`paged_attention_cpu`.
    Scores, softmax and the value sums are float32 (the kernel's comment has the algorithm);
    returns ``[num_tokens, num_heads, head_dim]`` bf16.

    Raises:
        ValueError: dtypes, shapes or a head size it does not take (:func:`prefill_attention_available`).
        MemoryError: its scratch (the packed K/V; the AMX build's P history for heads over 64 dims) could
            not be allocated.
    """
    n, heads, dim = q.shape
    if q.dtype != torch.bfloat16 or kv_cache.dtype != torch.bfloat16 or kv_cache.device.type != "cpu" \
            or not kv_cache.is_contiguous() or heads % kv_cache.shape[4] or dim != kv_cache.shape[5] \
            or dim % 16 or dim > PREFILL_MAX_HEAD_DIM:
        raise ValueError(f"prefill_attention_cpu: needs bf16 q and cache with head_dim a multiple of 16 up to "
                         f"{PREFILL_MAX_HEAD_DIM}; got q {tuple(q.shape)} {q.dtype}, cache {tuple(kv_cache.shape)} "
                         f"{kv_cache.dtype}")
    _check_int32("prefill_attention_cpu", query_start_loc, seq_lens, block_tables)
    q = q.contiguous()
    out = torch.empty_like(q)
    base, s_block, s_tok, s_head, s_kv = _layer_layout(kv_cache, layer)
    fn = library(prefill_library(dim)).pd_prefill_attention
    if fn.argtypes is None:
        fn.argtypes = [_p, _p, _i64, _i64, _i64, _p, _p, _i64, _p, _i64, _i64, _i64, _i64, _p, _i64, _i64,
                       ctypes.c_float]
        fn.restype = ctypes.c_int
    rc = fn(q.data_ptr(), out.data_ptr(), heads, kv_cache.shape[4], dim, query_start_loc.data_ptr(),
            seq_lens.data_ptr(), seq_lens.shape[0], base, s_block, s_tok, s_head, s_kv, block_tables.data_ptr(),
            block_tables.shape[1], kv_cache.shape[3], float(scale))
    if rc != 0:
        raise MemoryError("prefill_attention_cpu: could not allocate its scratch (packed K/V, P history)")
    return out
