"""Paged attention for DECODE steps: a Triton kernel and the torch reference it is tested against.

A decode step has exactly one new query token per sequence. Its K/V is already in the
block-major cache (:mod:`model.kv_cache`)::

    kv_cache[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]   (K at [:, :, 0], V at [:, :, 1])

and each sequence ``b`` attends to context positions ``0 .. seq_lens[b] - 1``, position ``p``
living at block ``block_tables[b, p // block_size]``, offset ``p % block_size``.

Algorithm
---------
PagedAttention (Kwon et al., "Efficient Memory Management for Large Language Model Serving
with PagedAttention", SOSP 2023; vLLM's ``paged_attention_v1``) with the one-pass online
softmax of FlashAttention (Dao et al., NeurIPS 2022; Milakov & Gimelshein 2018)::

    for each tile T of context tokens:           s_t = scale * q . k_t           (t in T)
        m'  = max(m, max_t s_t)                  running max
        l   = l * exp(m - m') + sum_t exp(s_t - m')          running softmax denominator
        acc = acc * exp(m - m') + sum_t exp(s_t - m') * v_t  running numerator
        m   = m'
    out = acc / l

Everything after the loads is float32; the result is cast to ``q.dtype``.

Work split (grouped-query attention: query head ``h`` reads KV head ``h // G``, ``G = H / H_kv``).
One program per (sequence, KV head) handles that head's whole query group, so each K/V tile
is loaded once and shared by the ``G`` query heads::

    grid = (B, H_kv)                                   block_tables[b] = [ 7, 2, 9, 0, 0 ]
                                                                          \\  |  /  └──┴─ padding: never read
    program (b, j):                                     tile 0: tokens 0..15, gathered slot by slot
      q[b, j*G : (j+1)*G, :]  ──┐                       tile 1: tokens 16..31     (pos // bs -> table,
                                ├─> online softmax <──   ...                        pos %  bs -> offset)
      K/V[block, layer, :, off, j, :]  ──┘              last tile masked at seq_lens[b]
      out[b, j*G : (j+1)*G, :]

A decode batch of a few sequences gives too few programs to fill a GPU (batch 1 of an 8-KV-head
model: 8 programs for 132 multiprocessors), so the context is also split (flash-decoding): grid
``(B, H_kv, S)``, program ``s`` runs the loop above over its ``ceil(seq_len / S)`` tokens (whole
tiles) and writes its ``(m, l, acc)``; a second kernel, one program per (sequence, query head),
merges the S partial softmaxes: ``M = max m_s``, ``out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s``.
S depends only on shapes (batch, heads, the block tables' width), never on ``seq_lens``, so a
captured CUDA graph replays for any lengths.

Tiles are ``BLOCK_T`` tokens, independent of ``block_size``: each token's slot is looked up in the
block table, so any block size works (5, 16, ...). ``head_dim`` and the query group are padded to
powers of two (``HEAD_P``, ``GROUP_P``) and masked, so any head_dim (24, 64, ...) works.
Loads outside ``pos < seq_len`` are masked off: neither the block-table padding nor the tail of
the last block is read.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships for Linux x86_64 only; the reference still works
    triton = None


def _check_inputs(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor) -> tuple[int, int, int]:
    """Validate shapes/dtypes/devices; return ``(block_size, num_kv_heads, group_size)``.

    Raises:
        ValueError: a shape, dtype or device mismatch (the message names it).
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [B, num_heads, head_dim], got shape {tuple(q.shape)}")
    if kv_cache.dim() != 6 or kv_cache.shape[2] != 2:
        raise ValueError("kv_cache must be [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], "
                         f"got shape {tuple(kv_cache.shape)}")
    batch, num_heads, head_dim = q.shape
    _, num_layers, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    if head_dim != cache_head_dim:
        raise ValueError(f"head_dim mismatch: q has {head_dim}, kv_cache has {cache_head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer {layer} out of range for a cache of {num_layers} layers")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be [B={batch}, max_blocks], got shape {tuple(block_tables.shape)}")
    if seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens must be [B={batch}], got shape {tuple(seq_lens.shape)}")
    if not q.dtype.is_floating_point or not kv_cache.dtype.is_floating_point:
        raise ValueError(f"q and kv_cache must be floating point, got {q.dtype} and {kv_cache.dtype}")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    devices = {t.device for t in (q, kv_cache, block_tables, seq_lens)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    return block_size, num_kv_heads, num_heads // num_kv_heads


def paged_attention_decode_reference(q: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                                     block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                     scale: float) -> torch.Tensor:
    """Decode attention in plain torch, one sequence at a time (the spec the kernel is tested against).

    Args:
        q: ``[B, num_heads, head_dim]`` float32/bfloat16/float16, one query token per sequence (RoPE applied).
        kv_cache: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``; only ``layer`` is read.
        layer: decoder layer to read.
        block_tables: ``[B, max_blocks]`` int32/int64 block ids; entries past a sequence's blocks are ignored.
        seq_lens: ``[B]`` int32/int64 context lengths, including the new token (whose K/V is in the cache).
        scale: softmax scale, usually ``head_dim ** -0.5``.
    Returns:
        ``[B, num_heads, head_dim]`` in ``q.dtype`` (computed in float32).
    """
    block_size, _, group = _check_inputs(q, kv_cache, layer, block_tables, seq_lens)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for b in range(q.shape[0]):
        pos = torch.arange(int(seq_lens[b]), device=q.device)                    # context positions
        blocks = block_tables[b, pos // block_size].long()
        k = kv_cache[blocks, layer, 0, pos % block_size].float()                 # [L, H_kv, D]
        v = kv_cache[blocks, layer, 1, pos % block_size].float()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # head h -> kv head h // G
        scores = torch.einsum("hd,lhd->hl", q[b].float(), k) * scale              # [H, L]
        out[b] = torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), v)            # [H, D]
    return out.to(q.dtype)


if triton is not None:

    @triton.jit
    def _paged_attention_decode_kernel(
        out_ptr, part_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, scale,
        stride_ob, stride_oh, stride_od,
        stride_qb, stride_qh, stride_qd,
        stride_cblk, stride_ctok, stride_chead, stride_cd,      # of kv_cache[:, layer, 0] (same for V)
        stride_btb, stride_btn,
        block_size, group_size, head_dim, num_heads,
        GROUP_P: tl.constexpr, HEAD_P: tl.constexpr, BLOCK_T: tl.constexpr, NUM_SPLITS: tl.constexpr,
    ):
        """Program (b, j, s): query heads ``j*G .. j*G+G-1`` of sequence b against KV head j over
        split s of the context. One split: the normalised output; several: the split's running max,
        denominator and numerator to ``part_ptr`` (``[B, H, NUM_SPLITS, HEAD_P + 2]`` float32)."""
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(seq_lens_ptr + seq)
        g = tl.arange(0, GROUP_P)
        d = tl.arange(0, HEAD_P)
        t = tl.arange(0, BLOCK_T)
        g_mask = g < group_size
        d_mask = d < head_dim
        heads = kv_head * group_size + g                                          # [GROUP_P] query heads

        q_mask = g_mask[:, None] & d_mask[None, :]
        q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :] * stride_qd,
                    mask=q_mask, other=0.0).to(tl.float32) * scale                # [GROUP_P, HEAD_P], pre-scaled

        m = tl.full([GROUP_P], float("-inf"), tl.float32)                         # running max
        l = tl.zeros([GROUP_P], tl.float32)                                       # running denominator
        acc = tl.zeros([GROUP_P, HEAD_P], tl.float32)                             # running numerator
        table = block_tables_ptr + seq * stride_btb
        head_off = kv_head * stride_chead + d * stride_cd                         # [HEAD_P]
        chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_T) * BLOCK_T          # tokens per split, whole tiles
        lo = split * chunk
        hi = tl.minimum(lo + chunk, seq_len)

        for start in range(lo, hi, BLOCK_T):
            pos = start + t                                                       # [BLOCK_T] context positions
            t_mask = pos < hi
            block = tl.load(table + (pos // block_size) * stride_btn, mask=t_mask, other=0).to(tl.int64)
            slot = block * stride_cblk + (pos % block_size) * stride_ctok         # [BLOCK_T], int64
            kv_off = slot[:, None] + head_off[None, :]                            # [BLOCK_T, HEAD_P]
            kv_mask = t_mask[:, None] & d_mask[None, :]
            k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
            v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)

            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)                    # [GROUP_P, BLOCK_T] = scale q.k
            s = tl.where(t_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))                              # finite: tile has >= 1 token
            alpha = tl.exp(m - m_new)                                             # rescales the old sums (0 at start)
            p = tl.exp(s - m_new[:, None])                                        # 0 at masked tokens
            l = l * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m = m_new

        if NUM_SPLITS == 1:
            out = acc / tl.where(l > 0.0, l, 1.0)[:, None]                        # seq_len 0 -> zeros, not NaN
            tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :] * stride_od,
                     out.to(out_ptr.dtype.element_ty), mask=q_mask)
        else:                                                                     # an empty split: m = -1e30, l = 0
            row = part_ptr + ((seq * num_heads + heads) * NUM_SPLITS + split) * (HEAD_P + 2)   # [GROUP_P]
            tl.store(row[:, None] + d[None, :], acc, mask=g_mask[:, None])
            tl.store(row + HEAD_P, tl.where(l > 0.0, m, -1e30), mask=g_mask)
            tl.store(row + HEAD_P + 1, l, mask=g_mask)

    @triton.jit
    def _paged_attention_reduce_kernel(
        out_ptr, part_ptr, stride_ob, stride_oh, stride_od, head_dim,
        HEAD_P: tl.constexpr, NUM_SPLITS: tl.constexpr,
    ):
        """Program (b, h): merge the ``NUM_SPLITS`` partial softmaxes of query head h of sequence b."""
        seq, head = tl.program_id(0), tl.program_id(1)
        num_heads = tl.num_programs(1)
        d = tl.arange(0, HEAD_P)
        row = part_ptr + (seq * num_heads + head) * NUM_SPLITS * (HEAD_P + 2)
        m = tl.full([1], -1e30, tl.float32)
        l = tl.zeros([1], tl.float32)
        acc = tl.zeros([HEAD_P], tl.float32)
        for split in range(NUM_SPLITS):
            part = row + split * (HEAD_P + 2)
            m_s = tl.load(part + HEAD_P + tl.arange(0, 1))
            l_s = tl.load(part + HEAD_P + 1 + tl.arange(0, 1))
            m_new = tl.maximum(m, m_s)
            alpha, beta = tl.exp(m - m_new), tl.exp(m_s - m_new)
            l = l * alpha + l_s * beta
            acc = acc * alpha + tl.load(part + d) * beta
            m = m_new
        out = acc / tl.where(l > 0.0, l, 1.0)
        tl.store(out_ptr + seq * stride_ob + head * stride_oh + d * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=d < head_dim)


def _kernel_is_interpreted() -> bool:
    """True when the kernel was built by the Triton interpreter (TRITON_INTERPRET=1 when triton.jit ran)."""
    return triton is not None and not isinstance(_paged_attention_decode_kernel, triton.runtime.JITFunction)


def num_splits_for(batch: int, num_kv_heads: int, max_ctx: int, block_t: int, device: torch.device) -> int:
    """Context splits per (sequence, KV head) so that a launch has enough programs to fill the GPU:
    about four per multiprocessor (a fixed 8 programs under the interpreter, so that tests on the CPU
    take the split path), at most one per ``block_t`` tokens of ``max_ctx`` (the block tables' width),
    at most :data:`MAX_SPLITS`. Depends on shapes only, so a captured CUDA graph stays valid."""
    target = 4 * _multiprocessors(device) if device.type == "cuda" else 8
    return max(1, min(-(-target // (batch * num_kv_heads)), -(-max_ctx // block_t), MAX_SPLITS))


MAX_SPLITS = 64
"""The most context splits of one (sequence, KV head): the reduce reads ``splits x (head_dim + 2)``
float32 partials per query head."""


def _multiprocessors(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


_SMS: dict[int, int] = {}


def paged_attention_decode_triton(q: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                                  block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                                  block_t: int = 32, num_splits: int | None = None) -> torch.Tensor:
    """Decode attention with the Triton kernel; same contract as :func:`paged_attention_decode_reference`.

    Launch grid ``(B, num_kv_heads, num_splits)``, then ``(B, num_heads)`` merging the splits when
    there are several (scratch: ``B x num_heads x num_splits x (head_dim + 2)`` float32).
    Preconditions not checked here (they would need a device sync): ``1 <= seq_lens[b] <=
    max_blocks * block_size`` and valid block ids. ``seq_lens[b] == 0`` yields zeros.

    Args:
        q, kv_cache, layer, block_tables, seq_lens, scale: as in :func:`paged_attention_decode_reference`.
        block_t: context tokens per tile (power of two; a multiple of a power-of-two block_size keeps
            each block's loads contiguous).
        num_splits: context splits per (sequence, KV head), each its own program, merged by a second
            kernel (flash-decoding: Dao et al., "Flash-Decoding for long-context inference", 2023;
            vLLM's ``paged_attention_v2``); None: :func:`num_splits_for`.
    Returns:
        ``[B, num_heads, head_dim]`` in ``q.dtype``.
    Raises:
        ValueError: shape/dtype/device mismatch, or ``block_t`` not a power of two.
        RuntimeError: triton is missing, or the inputs are not on CUDA and the kernel is not interpreted.
    """
    _, num_kv_heads, group = _check_inputs(q, kv_cache, layer, block_tables, seq_lens)
    if block_t <= 0 or block_t & (block_t - 1):
        raise ValueError(f"block_t must be a power of two, got {block_t}")
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    if triton is None:
        raise RuntimeError("paged_attention_decode_triton needs the triton package (not installed)")
    if q.device.type != "cuda" and not _kernel_is_interpreted():
        hint = (" (TRITON_INTERPRET=1 is set now, but was not when this module was imported: set it before "
                "importing triton)") if os.environ.get("TRITON_INTERPRET") == "1" else ""
        raise RuntimeError(f"the Triton paged-attention kernel needs CUDA tensors or TRITON_INTERPRET=1; got "
                           f"tensors on {q.device}{hint}")
    batch, num_heads, head_dim = q.shape
    if num_splits is None:
        num_splits = num_splits_for(batch, num_kv_heads, block_tables.shape[1] * kv_cache.shape[3], block_t, q.device)
    out = torch.empty_like(q)
    head_p = triton.next_power_of_2(head_dim)
    part = out if num_splits == 1 else torch.empty(batch, num_heads, num_splits, head_p + 2, dtype=torch.float32,
                                                   device=q.device)
    k_cache, v_cache = kv_cache[:, layer, 0], kv_cache[:, layer, 1]               # [num_blocks, bs, H_kv, D] views
    _paged_attention_decode_kernel[(batch, num_kv_heads, num_splits)](
        out, part, q, k_cache, v_cache, block_tables, seq_lens, float(scale),
        *out.stride(), *q.stride(), *k_cache.stride(), *block_tables.stride(),
        kv_cache.shape[3], group, head_dim, num_heads,
        GROUP_P=triton.next_power_of_2(group), HEAD_P=head_p, BLOCK_T=block_t, NUM_SPLITS=num_splits,
    )
    if num_splits > 1:
        _paged_attention_reduce_kernel[(batch, num_heads)](
            out, part, *out.stride(), head_dim, HEAD_P=head_p, NUM_SPLITS=num_splits)
    return out
