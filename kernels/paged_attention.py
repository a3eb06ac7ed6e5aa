"""Paged attention over the block-major KV cache: the torch path (CPU) and the
reference that GPU kernels are tested against.

Cache layout (see :mod:`model.kv_cache`)::

    kv_cache[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]

A step's tokens are one flat batch of ``num_tokens`` rows from ``B`` sequences
(prefill chunks and single decode tokens mixed). :class:`AttentionMetadata`
holds everything a layer needs, computed once per step.

Algorithm: PagedAttention (Kwon et al., SOSP 2023). The torch path gathers each
sequence's context through its block table into a padded ``[B, max_ctx]`` batch
and runs one ``scaled_dot_product_attention`` with a causal + length mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.kernels.cpu import DTYPES, available
from pdserve.kernels.cpu.attention import (
    attention_available,
    paged_attention_cpu,
    prefill_attention_available,
    prefill_attention_cpu,
)
from pdserve.kernels.cpu.fused import MAX_ROWS

CPU_KERNEL_MAX_QUERY = 8    # new tokens per sequence up to which the C kernel beats gather + SDPA (even at 16)


@dataclass(frozen=True)
class SequenceGroup:
    """Some of a step's sequences, as the attention kernels take them.

    Attributes:
        rows: ``[num_rows]`` int64, the group's rows of the step's flat batch, sequence by sequence.
        query_start_loc: ``[G + 1]`` int32 over those rows; ``seq_lens``: ``[G]`` int32;
        block_tables: ``[G, max_blocks]`` int32.
    """

    rows: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor


@dataclass(frozen=True)
class StepSplit:
    """A step that mixes decode-sized sequences (on a CPU at most :data:`CPU_KERNEL_MAX_QUERY` new tokens, on a
    GPU one) with prefill chunks: the first go to the decode kernel, the others to the prefill kernel or the
    torch path, as vLLM's attention backends run a batch's decodes and prefills apart. Given the whole step,
    the prefill kernel packs every sequence's context into its tile layouts, one decode row included: a step
    of a 512-token chunk and 32 decode rows at 2,048 tokens of context took 1.9x its two halves run apart
    (``bench/mixed_step.py``, AMX Xeon); on the torch path (a float32 cache) every decode row was padded to
    the chunk's length in one ``[B, max_q, max_ctx]`` batch: 12x and 39x the halves on bench-9m fp32 at 512
    and 2,048 tokens of context (1,212 -> 106 ms, 3,961 -> 117 ms split). ``prefill_torch``: the prefill
    group's own metadata where its chunks may take the torch path."""

    decode: SequenceGroup
    prefill: SequenceGroup
    prefill_torch: AttentionMetadata | None = None


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step attention inputs for a flat token batch.

    Attributes:
        positions: ``[num_tokens]`` int64, each token's position in its sequence.
        slot_mapping: ``[num_tokens]`` int64, ``block_id * block_size + offset`` where the token's KV goes.
        query_index: ``[B, max_q]`` int64, row of the flat batch for each (sequence, query) pair;
            padding points at row 0 and is masked out of the result by ``query_valid``.
        query_valid: ``[B, max_q]`` bool.
        ctx_block: ``[B, max_ctx]`` int64, block id of each context position (0 where padded);
            empty (``[1, 0]``) for a fresh prefill, which never gathers; None (with ``ctx_offset`` and
            ``attn_mask``) where the step's attention runs on the C kernels, which read the block tables.
        ctx_offset: ``[B, max_ctx]`` int64, offset inside the block (empty for a fresh prefill).
        attn_mask: ``[B, 1, max_q, max_ctx]`` bool, True where the query may attend to the key
            (empty for a fresh prefill, which runs causally).
        fresh_prefill: True when the step is one sequence with no earlier context,
            so attention can run causally on the fresh K/V without reading the cache.
        block_tables: ``[B, max_blocks]`` int32 block tables (padded with block 0).
        seq_lens: ``[B]`` int32 context lengths after this step.
        decode_only: every sequence has exactly one new token (the GPU decode kernel's case).
        query_start_loc: ``[B + 1]`` int32, sequence ``b``'s new tokens are rows ``[qsl[b], qsl[b+1])``.
        cpu_kernels: the step is CPU-side and decode-sized (:func:`cpu_kernels_apply`): attention,
            RMSNorm, RoPE and SiLU may run as the C kernels of :mod:`kernels.cpu`.
        split: a CPU or CUDA step mixing decode-sized sequences and prefill chunks, its two groups
            (:func:`split_step`); None otherwise.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_index: torch.Tensor
    query_valid: torch.Tensor
    ctx_block: torch.Tensor | None
    ctx_offset: torch.Tensor | None
    attn_mask: torch.Tensor | None
    fresh_prefill: bool
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    decode_only: bool
    query_start_loc: torch.Tensor
    cpu_kernels: bool = False
    split: StepSplit | None = None

    @property
    def max_query_len(self) -> int:
        return self.query_index.shape[1]

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]


def build_attention_metadata(
    query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int,
    device: torch.device | str = "cpu", kv_dtype: torch.dtype | None = None, head_dim: int | None = None,
    gather_fresh: bool = False,
) -> AttentionMetadata:
    """Build the metadata of a step over ``B`` sequences.

    Args:
        query_lens: new tokens of each sequence in this step (>= 1).
        seq_lens: context length of each sequence after this step (earlier tokens + new ones).
        block_tables: each sequence's block ids, at least ``ceil(seq_len / block_size)`` of them.
        block_size: tokens per block.
        device: where the step runs.
        kv_dtype: the KV cache's dtype; the CPU kernels are considered only when it is given
            (:func:`cpu_kernels_apply`).
        head_dim: given by a caller whose queries have the cache's dtype, so that a bf16 step whose
            attention runs on the C prefill kernel skips the torch path's gather indices and mask
            (``[B, 1, max_q, max_ctx]``: 40 ms for a 512-token chunk beside 32 rows at 2,048 tokens of context).
        gather_fresh: a fresh prompt reads its K/V from the cache like a later chunk (a :class:`StepSplit`'s
            prefill group, whose attention is not given the step's K/V).
    Raises:
        ValueError: inconsistent lengths or a block table too short.
    """
    if not (len(query_lens) == len(seq_lens) == len(block_tables)) or not query_lens:
        raise ValueError("query_lens, seq_lens and block_tables must be non-empty and of equal length")
    num_seqs, max_q = len(query_lens), max(query_lens)
    fresh = num_seqs == 1 and query_lens[0] == seq_lens[0] and not gather_fresh
    positions, slots = [], []
    query_index = torch.zeros(num_seqs, max_q, dtype=torch.long)
    row = 0
    for i, (q_len, s_len, table) in enumerate(zip(query_lens, seq_lens, block_tables)):
        if not 1 <= q_len <= s_len:
            raise ValueError(f"sequence {i}: query_len {q_len} must be in [1, seq_len={s_len}]")
        if len(table) * block_size < s_len:
            raise ValueError(f"sequence {i}: {len(table)} blocks cannot hold {s_len} tokens")
        pos = range(s_len - q_len, s_len)
        positions.extend(pos)
        slots.extend(table[p // block_size] * block_size + p % block_size for p in pos)
        query_index[i, :q_len] = torch.arange(row, row + q_len)
        row += q_len
    q_lens = torch.tensor(query_lens)
    s_lens = torch.tensor(seq_lens)
    query_valid = torch.arange(max_q)[None, :] < q_lens[:, None]
    max_blocks = max(len(t) for t in block_tables)
    tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in block_tables], dtype=torch.int32)
    dev = torch.device(device)
    cpu_kernels = kv_dtype is not None and cpu_kernels_apply(dev, max_q, len(positions), kv_dtype)
    c_prefill = dev.type == "cpu" and kv_dtype == torch.bfloat16 and head_dim is not None \
        and prefill_attention_available(head_dim)
    split = None if cpu_kernels or kv_dtype is None else \
        split_step(query_lens, s_lens, tables, block_size, dev, kv_dtype, torch_path=not c_prefill)
    if fresh:                           # a fresh prompt attends causally to its own K/V: no gather, no mask
        ctx_block, ctx_offset, mask = (torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0, dtype=torch.long),
                                       torch.zeros(1, 1, 0, 0, dtype=torch.bool))
    elif cpu_kernels or c_prefill or split is not None:   # the C kernels read the block tables; a split has its own
        ctx_block = ctx_offset = mask = None
    else:
        ctx_block, ctx_offset, mask = _torch_gather(q_lens, s_lens, tables, query_valid, block_size)
    return AttentionMetadata(
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        query_index=query_index.to(device),
        query_valid=query_valid.to(device),
        ctx_block=None if ctx_block is None else ctx_block.to(device),
        ctx_offset=None if ctx_offset is None else ctx_offset.to(device),
        attn_mask=None if mask is None else mask.to(device),
        fresh_prefill=fresh,
        block_tables=tables.to(device),
        seq_lens=s_lens.to(torch.int32).to(device),
        decode_only=max_q == 1,
        query_start_loc=torch.cat([torch.zeros(1, dtype=torch.int32), q_lens.cumsum(0).to(torch.int32)]).to(device),
        cpu_kernels=cpu_kernels,
        split=split,
    )


def _torch_gather(q_lens: torch.Tensor, s_lens: torch.Tensor, tables: torch.Tensor, query_valid: torch.Tensor,
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch path's ``ctx_block``, ``ctx_offset`` (``[B, max_ctx]`` int64) and ``attn_mask``
    (``[B, 1, max_q, max_ctx]`` bool) of a step that reads earlier context."""
    num_seqs, max_q, max_ctx = q_lens.shape[0], query_valid.shape[1], int(s_lens.max())
    k_pos = torch.arange(max_ctx)
    ctx_block = tables[:, k_pos // block_size].long() * (k_pos[None, :] < s_lens[:, None])   # 0 where padded
    q_pos = (s_lens - q_lens)[:, None] + torch.arange(max_q)[None, :]    # [B, max_q] absolute positions
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < s_lens[:, None, None])
    mask[:, :, 0] |= ~query_valid                                        # padded rows see key 0: no NaN
    ctx_offset = (k_pos % block_size).expand(num_seqs, max_ctx).contiguous()
    return ctx_block, ctx_offset, mask[:, None]


def split_step(query_lens: list[int], seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int,
               device: torch.device, kv_dtype: torch.dtype, torch_path: bool) -> StepSplit | None:
    """The :class:`StepSplit` of a step whose sequences are some decode-sized and some longer: on the CPU with a
    float32 or bf16 cache where the decode kernel builds, decode-sized meaning at most
    :data:`CPU_KERNEL_MAX_QUERY` new tokens; on CUDA, one (the Triton decode kernel's case). Else None.
    ``seq_lens``: ``[B]`` int64 and ``block_tables``: ``[B, max_blocks]`` int32, on the CPU. ``torch_path``: the
    prefill chunks may take the torch path, so their group carries its own metadata (always on CUDA)."""
    if device.type == "cpu" and kv_dtype in DTYPES and attention_available():
        return split_groups(query_lens, seq_lens, block_tables, block_size, device, CPU_KERNEL_MAX_QUERY, torch_path)
    if device.type == "cuda":
        return split_groups(query_lens, seq_lens, block_tables, block_size, device, 1, True)
    return None


def split_groups(query_lens: list[int], seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                 device: torch.device, decode_max_query: int, torch_path: bool) -> StepSplit | None:
    """:func:`split_step`'s groups, on ``device``: sequences of at most ``decode_max_query`` new tokens and the
    others; None when one group would be empty."""
    short = [q <= decode_max_query for q in query_lens]
    if all(short) or not any(short):
        return None
    q_lens = torch.tensor(query_lens)
    starts = q_lens.cumsum(0) - q_lens                     # each sequence's first row in the step

    def group(members: list[int]) -> SequenceGroup:
        lens = q_lens[members]
        qsl = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
        return SequenceGroup(
            rows=(torch.repeat_interleave(starts[members] - qsl[:-1], lens) + torch.arange(int(qsl[-1]))).to(device),
            query_start_loc=qsl.to(torch.int32).to(device),
            seq_lens=seq_lens[members].to(torch.int32).to(device),
            block_tables=block_tables[members].contiguous().to(device))

    long = [i for i, s in enumerate(short) if not s]
    torch_meta = None
    if torch_path:             # gathered: the fresh-prompt path would need the step's K/V, not the cache's
        torch_meta = build_attention_metadata(
            [query_lens[i] for i in long], [int(seq_lens[i]) for i in long],
            [block_tables[i, :-(-int(seq_lens[i]) // block_size)].tolist() for i in long], block_size, device,
            gather_fresh=True)
    return StepSplit(decode=group([i for i, s in enumerate(short) if s]), prefill=group(long),
                     prefill_torch=torch_meta)


def write_kv(kv_cache: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``k``, ``v`` (``[num_tokens, num_kv_heads, head_dim]``) of ``layer`` at their slots."""
    block_size = kv_cache.shape[3]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    kv_cache[blocks, layer, 0, offsets] = k.to(kv_cache.dtype)
    kv_cache[blocks, layer, 1, offsets] = v.to(kv_cache.dtype)


def paged_attention_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int,
    meta: AttentionMetadata, scale: float,
) -> torch.Tensor:
    """Attention of a flat token batch against each sequence's paged context.

    The new tokens' K/V must already be written to the cache (:func:`write_kv`).

    Args:
        q: ``[num_tokens, num_heads, head_dim]`` queries (RoPE applied).
        k, v: ``[num_tokens, num_kv_heads, head_dim]`` the step's fresh keys and values
            (read only on the ``fresh_prefill`` path).
        kv_cache: the cache tensor; layer ``layer`` is read.
        meta: the step's :class:`AttentionMetadata`.
        scale: softmax scale, usually ``head_dim ** -0.5``.
    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``.
    """
    if meta.attn_mask is None:
        raise ValueError("paged_attention_torch: this step's metadata was built for the C attention kernels "
                         "(no gather indices); build it without head_dim")
    if meta.fresh_prefill:  # one prompt, no earlier context: plain causal attention
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            is_causal=True, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)
    keys = kv_cache[meta.ctx_block, layer, 0, meta.ctx_offset].to(q.dtype)      # [B, max_ctx, Hkv, D]
    values = kv_cache[meta.ctx_block, layer, 1, meta.ctx_offset].to(q.dtype)
    queries = q[meta.query_index]                                                # [B, max_q, H, D]
    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=meta.attn_mask, scale=scale, enable_gqa=True)                  # [B, H, max_q, D]
    return out.transpose(1, 2)[meta.query_valid]                                 # [num_tokens, H, D]


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int,
    meta: AttentionMetadata, scale: float,
) -> torch.Tensor:
    """Attention for one layer of a step, on the best path for the device: the Triton
    decode kernel for all-decode steps on CUDA; on CPUs the C kernel for steps of at most
    :data:`CPU_KERNEL_MAX_QUERY` new tokens per sequence (decode, speculative verification), the
    C prefill kernel for longer bf16 steps (:func:`~kernels.cpu.attention.prefill_attention_cpu`; on AMX
    tiles where granted, :func:`~kernels.cpu.attention.prefill_attention_path`);
    the torch path otherwise. Arguments and result as :func:`paged_attention_torch`."""
    if q.is_cuda and meta.decode_only and not meta.fresh_prefill:
        from pdserve.kernels.paged_attention_triton import paged_attention_decode_triton
        return paged_attention_decode_triton(q, kv_cache, layer, meta.block_tables, meta.seq_lens, scale)
    if q.is_cuda and meta.split is not None:
        return split_attention(q, kv_cache, layer, meta.split, scale, c_prefill=False, triton=True)
    if meta.cpu_kernels:
        return paged_attention_cpu(q, kv_cache, layer, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale)
    if q.dtype == kv_cache.dtype == torch.bfloat16 and q.device.type == "cpu" \
            and prefill_attention_available(q.shape[-1]):
        if meta.split is not None:
            return split_attention(q, kv_cache, layer, meta.split, scale, c_prefill=True)
        return prefill_attention_cpu(q, kv_cache, layer, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale)
    if meta.split is not None and meta.split.prefill_torch is not None:
        return split_attention(q, kv_cache, layer, meta.split, scale, c_prefill=False)
    return paged_attention_torch(q, k, v, kv_cache, layer, meta, scale)


def split_attention(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, split: StepSplit, scale: float,
                    c_prefill: bool, triton: bool = False) -> torch.Tensor:
    """A mixed step's attention in two calls: the decode-sized sequences' rows on
    :func:`~kernels.cpu.attention.paged_attention_cpu` or, with ``triton`` (a GPU's one-token rows), on
    :func:`~kernels.paged_attention_triton.paged_attention_decode_triton`; the prefill chunks' on
    :func:`~kernels.cpu.attention.prefill_attention_cpu` where ``c_prefill`` (bf16 ``q`` and cache), else on the
    torch path over the group's own metadata (``split.prefill_torch``). Each row's result is the one its kernel
    gives it with the other group absent. ``q``: ``[num_tokens, num_heads, head_dim]``; returns the same shape
    and dtype."""
    out = torch.empty_like(q)
    d, p = split.decode, split.prefill
    if triton:
        from pdserve.kernels.paged_attention_triton import paged_attention_decode_triton
        out[d.rows] = paged_attention_decode_triton(q[d.rows], kv_cache, layer, d.block_tables, d.seq_lens, scale)
    else:
        out[d.rows] = paged_attention_cpu(q[d.rows], kv_cache, layer, d.query_start_loc, d.seq_lens,
                                          d.block_tables, scale)
    if c_prefill:
        out[p.rows] = prefill_attention_cpu(q[p.rows], kv_cache, layer, p.query_start_loc, p.seq_lens,
                                            p.block_tables, scale)
    else:
        out[p.rows] = paged_attention_torch(q[p.rows], None, None, kv_cache, layer, split.prefill_torch, scale)
    return out


def cpu_kernels_apply(device: torch.device, max_query_len: int, num_tokens: int, kv_dtype: torch.dtype) -> bool:
    """Whether a step runs the C kernels: on the CPU, a float32 or bf16 KV cache, at most
    :data:`CPU_KERNEL_MAX_QUERY` new tokens per sequence and :data:`~kernels.cpu.fused.MAX_ROWS`
    in all, and the libraries built here. The one place this is decided: the metadata carries it."""
    return (device.type == "cpu" and kv_dtype in DTYPES and max_query_len <= CPU_KERNEL_MAX_QUERY
            and num_tokens <= MAX_ROWS and attention_available() and available("fused"))
