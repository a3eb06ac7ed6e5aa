"""Decode steps on padded batch buckets with static buffers, replayed as CUDA graphs on GPUs.

A decode step's shapes depend only on the batch size, so the runner keeps one set of
static input buffers sized for the largest bucket and pads every step up to the
nearest bucket::

    buckets (1, 2, 4, 8, 16, 32, 64)      batch of 5 -> bucket 8
    row:        0   1   2   3   4 | 5   6   7
    token:      real tokens       | 0   0   0
    slot:       real slots        | scratch block, offset 0   (a block reserved for padding)
    block table real tables       | [scratch]
    seq len     real lengths      | 1

On CUDA each bucket's forward is captured once as a ``torch.cuda.CUDAGraph``
(largest bucket first, all sharing one memory pool) and replayed; attention then goes
through the Triton paged-attention kernel, whose inputs (block tables, sequence
lengths) live in the static buffers. On CPU there is no graph to capture; where the
model's decode stack runs (:func:`model.cpu_stack.decode_graph`), the whole step, from
the static buffers to the logits, is one C call over the real rows (no padding: the
kernels are batch-invariant), otherwise the runner runs the padded step eagerly, its
metadata built by tensor ops from the static buffers. The buffers are filled from host
arrays (on CPU they are the same memory). Design after nano-vllm's ``model_runner.py``
and mini-sglang's ``engine/graph.py``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import torch

from pdserve.kernels.cpu.decode_graph import DecodeGraph
from pdserve.kernels.paged_attention import AttentionMetadata, cpu_kernels_apply
from pdserve.model.cpu_stack import decode_graph
from pdserve.model.kv_cache import BlockPool
from pdserve.model.runner import ModelRunner, StepInput

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def decode_metadata(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                    cpu_kernels: bool) -> AttentionMetadata:
    """Metadata of a decode step (one new token per row) from ``[B, max_blocks]`` int32 block
    tables and ``[B]`` int32 context lengths (the new token included). ``cpu_kernels``: the step
    runs the C kernels (:func:`~kernels.paged_attention.cpu_kernels_apply`); otherwise the gather
    indices and mask of the torch attention path are built too (never on CUDA, where the Triton
    kernel reads the block tables)."""
    with_torch_path = not cpu_kernels and block_tables.device.type != "cuda"
    num_seqs = block_tables.shape[0]
    positions = seq_lens.long() - 1
    rows = torch.arange(num_seqs, device=block_tables.device)
    slots = block_tables[rows, positions // block_size].long() * block_size + positions % block_size
    empty = torch.empty(0, dtype=torch.long, device=block_tables.device)
    ctx_block = ctx_offset = mask = empty
    if with_torch_path:
        max_ctx = int(seq_lens.max())
        k_pos = torch.arange(max_ctx, device=block_tables.device)
        ctx_block = block_tables[:, k_pos // block_size].long()
        ctx_offset = (k_pos % block_size).expand(num_seqs, max_ctx)
        mask = (k_pos[None, :] < seq_lens[:, None])[:, None, None, :]
    return AttentionMetadata(
        positions=positions, slot_mapping=slots, query_index=rows[:, None],
        query_valid=torch.ones(num_seqs, 1, dtype=torch.bool, device=block_tables.device),
        ctx_block=ctx_block, ctx_offset=ctx_offset, attn_mask=mask, fresh_prefill=False,
        block_tables=block_tables, seq_lens=seq_lens, decode_only=True,
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device=block_tables.device),
        cpu_kernels=cpu_kernels)


class GraphRunner:
    """Runs decode steps (exactly one new token per sequence) on padded buckets.

    Args:
        runner: the model and its KV cache.
        pool: the block pool; one block is reserved for padded rows for the runner's lifetime.
        max_blocks_per_seq: block-table width (the model's context in blocks).
        buckets: batch sizes to pad to, ascending.
        capture: capture CUDA graphs (only meaningful on CUDA).
    Raises:
        ValueError: empty or unsorted buckets.
    """

    def __init__(self, runner: ModelRunner, pool: BlockPool, max_blocks_per_seq: int,
                 buckets: Sequence[int] = DEFAULT_BUCKETS, capture: bool | None = None) -> None:
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"buckets must be ascending positive batch sizes, got {buckets}")
        self.runner, self.buckets = runner, tuple(buckets)
        self.block_size = runner.spec.block_size
        self.scratch_block = pool.allocate(1)[0]
        device, n = torch.device(runner.device), self.buckets[-1]
        self._host = (np.zeros(n, np.int64), np.ones(n, np.int32),         # token ids, context lengths,
                      np.full((n, max_blocks_per_seq), self.scratch_block, np.int32))   # block tables
        self.input_ids, self.seq_lens, self.block_tables = (torch.from_numpy(a).to(device) for a in self._host)
        self.capture = device.type == "cuda" if capture is None else capture
        self._cpu_graph: DecodeGraph | None = None
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        if self.capture:
            self._capture_all()

    @property
    def max_batch_size(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, batch_size: int) -> int:
        """The smallest bucket that holds ``batch_size`` rows.

        Raises:
            ValueError: ``batch_size`` is not in ``[1, max_batch_size]``.
        """
        for b in self.buckets:
            if batch_size <= b:
                if batch_size < 1:
                    break
                return b
        raise ValueError(f"batch of {batch_size} is outside the graph buckets (1..{self.max_batch_size})")

    def run(self, batch: list[StepInput]) -> torch.Tensor:
        """``[len(batch), vocab]`` float32 logits of a decode step.

        Raises:
            ValueError: a sequence brings other than one new token, or the batch exceeds the largest bucket.
        """
        size, bucket = len(batch), self._decode_bucket(batch)
        self._fill(batch, bucket)
        if self.capture:
            self._graphs[bucket].replay()
            return self._outputs[bucket][:size].clone()
        if (graph := self._step_graph(size)) is not None:
            return graph.run(size, max(s.num_computed for s in batch) + 1)
        return self._forward(bucket)[:size]

    def run_steps(self, batch: list[StepInput], steps: int, temperatures: torch.Tensor | None = None,
                  log_noise: torch.Tensor | None = None, stop_ids: Sequence[int] = (),
                  interrupt: ctypes.c_int32 | None = None, top_ks: torch.Tensor | None = None,
                  ) -> list[list[int]] | None:
        """Up to ``steps`` decode steps of ``batch`` in one C call (multi-step decoding: greedy rows, and
        rows sampled from ``softmax(logits / temperature)``, top-k cut or not, with noise drawn ahead; see
        :meth:`DecodeGraph.run_steps` for ``temperatures``, ``log_noise`` and ``top_ks``; each row's blocks must hold
        ``steps - 1`` more tokens), or ``None`` where the step does not run as one C call (GPUs, no decode
        stack): the caller then runs single steps.

        Returns:
            Per row, the tokens sampled, one per step run (the same count for every row, at least 1):
            the loop ends early after a step that sampled one of ``stop_ids`` or once ``interrupt`` is set.
        Raises:
            ValueError: as :meth:`run` or :meth:`DecodeGraph.run_steps`, or a row's blocks too short for
                ``steps`` more tokens.
        """
        size, bucket = len(batch), self._decode_bucket(batch)
        if self.capture or (graph := self._step_graph(size)) is None:
            return None
        self._fill(batch, bucket)
        tokens = graph.run_steps(size, max(s.num_computed for s in batch) + 1, steps, temperatures, log_noise,
                                 stop_ids, interrupt, top_ks)
        return tokens.t().tolist()

    def _decode_bucket(self, batch: list[StepInput]) -> int:
        """The bucket of a decode step's ``batch``.

        Raises:
            ValueError: a sequence brings other than one new token, or the batch exceeds the largest bucket.
        """
        if any(len(s.token_ids) != 1 for s in batch):
            raise ValueError("GraphRunner runs decode steps: exactly one new token per sequence")
        return self.bucket_for(len(batch))

    def _fill(self, batch: list[StepInput], bucket: int) -> None:
        """Rows ``[0, bucket)`` of the static buffers: the batch, then padded rows that write into the scratch block."""
        size, (ids, lens, tables) = len(batch), self._host
        ids[:size] = [s.token_ids[0] for s in batch]
        lens[:size] = [s.num_computed + 1 for s in batch]
        tables[:bucket] = self.scratch_block
        for row, s in enumerate(batch):
            n = min(len(s.block_table), tables.shape[1])
            tables[row, :n] = s.block_table[:n]
        ids[size:bucket], lens[size:bucket] = 0, 1
        if self.input_ids.device.type != "cpu":                 # on CPU the buffers are the host arrays
            for buf, host in zip((self.input_ids, self.seq_lens, self.block_tables), self._host):
                buf[:bucket].copy_(torch.from_numpy(host[:bucket]))

    def _step_graph(self, size: int) -> DecodeGraph | None:
        """The C decode step over the static buffers, where the model's stack runs this step (CPU only)."""
        if not cpu_kernels_apply(self.input_ids.device, 1, size, self.runner.kv_cache.dtype):
            return None
        self._cpu_graph = decode_graph(self.runner.model, self.input_ids, self.seq_lens, self.block_tables,
                                       self.runner.kv_cache, self.block_tables.shape[1] * self.block_size,
                                       current=self._cpu_graph)
        return self._cpu_graph

    def _forward(self, bucket: int) -> torch.Tensor:
        cpu_kernels = cpu_kernels_apply(self.input_ids.device, 1, bucket, self.runner.kv_cache.dtype)
        meta = decode_metadata(self.block_tables[:bucket], self.seq_lens[:bucket], self.block_size, cpu_kernels)
        model = self.runner.model
        return model.compute_logits(model(self.input_ids[:bucket], meta, self.runner.kv_cache))

    def _capture_all(self) -> None:
        """Capture every bucket, largest first, into one shared memory pool (CUDA only)."""
        pool = None
        for bucket in reversed(self.buckets):
            self._forward(bucket)  # warm up (Triton autotune, allocator)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[bucket] = self._forward(bucket)
            pool = graph.pool()
            self._graphs[bucket] = graph
