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
lengths) live in the static buffers. On CPU there is no graph to capture: the runner
runs the same padded step eagerly, with the step's metadata built by tensor ops from
the static buffers instead of per-sequence Python loops, and attention through the C
kernel (:mod:`kernels.cpu.attention`) where it builds. Design after nano-vllm's
``model_runner.py`` and mini-sglang's ``engine/graph.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.kernels.paged_attention import AttentionMetadata, cpu_kernels_apply
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
        device, n = runner.device, self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.block_tables = torch.full((n, max_blocks_per_seq), self.scratch_block, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.capture = torch.device(device).type == "cuda" if capture is None else capture
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
        if any(len(s.token_ids) != 1 for s in batch):
            raise ValueError("GraphRunner runs decode steps: exactly one new token per sequence")
        size, bucket = len(batch), self.bucket_for(len(batch))
        self._fill(batch, bucket)
        if self.capture:
            self._graphs[bucket].replay()
            return self._outputs[bucket][:size].clone()
        return self._forward(bucket)[:size]

    def _fill(self, batch: list[StepInput], bucket: int) -> None:
        size, width = len(batch), self.block_tables.shape[1]
        self.input_ids[:size] = torch.tensor([s.token_ids[0] for s in batch])
        self.seq_lens[:size] = torch.tensor([s.num_computed + 1 for s in batch], dtype=torch.int32)
        tables = torch.full((size, width), self.scratch_block, dtype=torch.int32)
        for row, s in enumerate(batch):
            tables[row, :len(s.block_table)] = torch.tensor(s.block_table[:width], dtype=torch.int32)
        self.block_tables[:size] = tables
        self.input_ids[size:bucket] = 0                      # padded rows: write into the scratch block
        self.seq_lens[size:bucket] = 1
        self.block_tables[size:bucket] = self.scratch_block

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
