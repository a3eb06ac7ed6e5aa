"""A whole decode step in one C call over static buffers: the CPU counterpart of a captured CUDA graph.

A CUDA graph runner keeps static input buffers and replays one captured forward; on a CPU there is
nothing to capture, but the same shape of work pays: :class:`DecodeGraph` binds a
:class:`~kernels.cpu.decode_stack.DecodeStack` to the graph runner's static buffers (token ids,
context lengths, block tables), the KV cache, the embedding, the rotary tables and the LM head, and
:meth:`DecodeGraph.run` does the whole step in ``decode_stack.c: pd_decode_graph``: slot mapping,
embedding lookup, rotary rows, every layer, the final norm and the LM head into float32 logits.
What it saves is the per-step tensor work around the stack (metadata, embedding, rotary tables,
the LM head's wrapper, about 0.5 ms a step on one core), which at batch 1 was a tenth of a bf16
step and a quarter of an INT4 one. Its logits are bit-identical to the per-operation path's.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

import torch

from pdserve.kernels.cpu import library
from pdserve.kernels.cpu.decode_stack import DecodeStack, LinearSpec, _Linear, _p

_i64 = ctypes.c_int64


class _Graph(ctypes.Structure):
    _fields_ = [("token_ids", _p), ("seq_lens", _p), ("tables", _p), ("max_blocks", _i64), ("block_size", _i64),
                ("num_blocks", _i64), ("embed", _p), ("vocab", _i64), ("cos_table", _p), ("sin_table", _p),
                ("positions", _i64), ("cache", _p), ("s_layer_bytes", _i64), ("s_block", _i64), ("s_tok", _i64),
                ("s_head", _i64), ("s_v", _i64), ("lm_head", _Linear)]


class DecodeGraph:
    """One model's decode step bound to static buffers, run by one C call.

    Args:
        stack: the model's decoder layers (:class:`DecodeStack`).
        embed: ``[vocab, hidden]`` contiguous embedding weight of the stack's dtype.
        lm_head: the LM head as the stack takes projections (``in_features`` = hidden).
        rope: ``positions [P] int64 -> (cos, sin)`` float32, each ``[P, head_dim]`` or ``[P, 1, head_dim]``
            (the model's rotary embedding); tables are built from it for positions ``0 .. P - 1`` and
            grown on demand up to ``max_positions``.
        input_ids, seq_lens, block_tables: the static buffers, ``[R]`` int64, ``[R]`` int32 and
            ``[R, max_blocks]`` int32, contiguous; a step reads rows ``[0, n)`` of each.
        kv_cache: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` contiguous.
        max_positions: the longest context a step may have (tokens).
    Raises:
        ValueError: buffers, embedding or head that do not fit the stack.
    """

    def __init__(self, stack: DecodeStack, embed: torch.Tensor, lm_head: LinearSpec,
                 rope: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], input_ids: torch.Tensor,
                 seq_lens: torch.Tensor, block_tables: torch.Tensor, kv_cache: torch.Tensor,
                 max_positions: int) -> None:
        rows = input_ids.shape[0]
        if embed.dtype != stack.dtype or embed.dim() != 2 or embed.shape[1] != stack.hidden \
                or not embed.is_contiguous() or lm_head.in_features != stack.hidden:
            raise ValueError(f"DecodeGraph: embedding {tuple(embed.shape)} {embed.dtype} or LM head "
                             f"{lm_head.out_features} x {lm_head.in_features} does not fit the stack")
        if input_ids.dtype != torch.int64 or seq_lens.dtype != torch.int32 or block_tables.dtype != torch.int32 \
                or input_ids.shape != (rows,) or seq_lens.shape != (rows,) or block_tables.dim() != 2 \
                or block_tables.shape[0] != rows or not all(t.is_contiguous() for t in (input_ids, seq_lens,
                                                                                       block_tables)):
            raise ValueError("DecodeGraph: input_ids [R] int64, seq_lens [R] int32, block_tables [R, W] int32, "
                             "contiguous")
        if kv_cache.dtype != stack.dtype or not kv_cache.is_contiguous() or kv_cache.dim() != 6 \
                or kv_cache.shape[1] < stack.num_layers \
                or kv_cache.shape[4:] != (stack.num_kv_heads, stack.head_dim):
            raise ValueError(f"DecodeGraph: cache {tuple(kv_cache.shape)} {kv_cache.dtype} does not fit the stack")
        self.stack, self.rope, self.max_positions = stack, rope, max_positions
        self.vocab = lm_head.out_features
        self._keep = (embed, input_ids, seq_lens, block_tables, kv_cache)
        self._ptrs = [t.data_ptr() for t in self._keep]
        s_block, s_layer, s_kv, s_tok, s_head, _ = kv_cache.stride()
        self._graph = _Graph(
            token_ids=input_ids.data_ptr(), seq_lens=seq_lens.data_ptr(), tables=block_tables.data_ptr(),
            max_blocks=block_tables.shape[1], block_size=kv_cache.shape[3], num_blocks=kv_cache.shape[0],
            embed=embed.data_ptr(), vocab=embed.shape[0], cache=kv_cache.data_ptr(),
            s_layer_bytes=s_layer * kv_cache.element_size(), s_block=s_block, s_tok=s_tok, s_head=s_head, s_v=s_kv,
            lm_head=stack.linear_struct(lm_head, (lm_head.out_features, stack.hidden), "lm_head"))
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None
        self._fn = library("decode_stack").pd_decode_graph
        self._fn.argtypes, self._fn.restype = [_p, _p, _i64, _p], ctypes.c_int
        self._steps = library("decode_stack").pd_decode_graph_steps
        self._steps.argtypes = [_p, _p, _i64, _i64, _p, _p, _p, _p, _i64, _p, _p, _p, _p]
        self._steps.restype = ctypes.c_int

    def valid(self) -> bool:
        """Whether every tensor the graph points to (the stack's included) still has the storage it was built on."""
        return self.stack.valid() and self.buffers_valid()

    def buffers_valid(self) -> bool:
        """:meth:`valid` for the graph's own tensors (buffers, cache, embedding, tables, head) only, for a
        caller that has just checked the stack."""
        return list(map(torch.Tensor.data_ptr, self._keep)) == self._ptrs

    def _ensure_positions(self, needed: int) -> None:
        """Rotary tables covering positions ``0 .. needed - 1``: doubled as contexts grow, capped at
        ``max_positions`` (a step past it is refused by the C side)."""
        have = self._graph.positions
        if needed <= have:
            return
        size = min(max(needed, 2 * have, 256), self.max_positions)
        cos, sin = self.rope(torch.arange(size, dtype=torch.int64))
        cos, sin = (t.reshape(size, self.stack.head_dim).float().contiguous() for t in (cos, sin))
        self._tables = (cos, sin)
        self._graph.cos_table, self._graph.sin_table, self._graph.positions = cos.data_ptr(), sin.data_ptr(), size

    def run(self, n: int, max_seq_len: int) -> torch.Tensor:
        """The step of rows ``[0, n)`` of the static buffers, whose longest context is ``max_seq_len``
        tokens (the new one included): ``[n, vocab]`` float32 logits (a new tensor).

        Raises:
            ValueError: a token id outside the vocabulary, a context outside ``[1, max_positions]`` or a
                block id outside the cache (checked before anything is written), or ``n`` out of range.
            MemoryError: scratch memory could not be allocated.
            RuntimeError: AMX tiles were refused to this process.
        """
        if not 0 < n <= self._keep[1].shape[0]:
            raise ValueError(f"DecodeGraph.run: {n} rows, the buffers hold {self._keep[1].shape[0]}")
        self._ensure_positions(min(max_seq_len, self.max_positions))
        logits = torch.empty(n, self.vocab, dtype=torch.float32)
        rc = self._fn(self.stack.c_model, ctypes.byref(self._graph), n, logits.data_ptr())
        self._check(rc, "run")
        return logits

    def run_steps(self, n: int, max_seq_len: int, steps: int, temperatures: torch.Tensor | None = None,
                  log_noise: torch.Tensor | None = None, stop_ids: Sequence[int] = (),
                  interrupt: ctypes.c_int32 | None = None, top_ks: torch.Tensor | None = None) -> torch.Tensor:
        """Up to ``steps`` decode steps of rows ``[0, n)`` in one C call (multi-step decoding,
        ``decode_stack.c: pd_decode_graph_steps``), each step's tokens feeding the next. A row is greedy
        (torch's argmax index on ties and NaN) unless ``temperatures[row] > 0``, which samples
        ``argmax(logits / temperature - log_noise[step, row])`` over its ``top_ks[row]`` largest entries
        (:func:`model.sampling.temperature_draw`).
        The static buffers are not changed.

        Args:
            n, max_seq_len: as :meth:`run`, for the first step; every row needs ``steps - 1`` more
                positions in its block table.
            steps: steps to run at most (>= 1).
            temperatures: ``[n]`` float32 (0: greedy), or ``None``: every row greedy.
            log_noise: ``[steps, n, vocab]`` float32 contiguous (:func:`model.sampling.log_noise` of each row's
                next output indexes), needed with ``temperatures``; greedy rows' entries are not read.
            stop_ids: token ids after which the loop ends (the step that sampled one is kept).
            interrupt: a flag another thread sets to a non-zero value to end the loop after the step
                in progress (the scheduler has work); ``None``: never.
            top_ks: ``[n]`` int32 top-k of the sampled rows (0: no cut), or ``None``: none.
        Returns:
            ``[done, n]`` int64 tokens, row ``s`` sampled at step ``s``, ``1 <= done <= steps``: the tokens
            :meth:`run` then the same sampling would give step by step.
        Raises:
            ValueError: ``steps`` < 1, ``temperatures`` / ``log_noise`` of the wrong shape or dtype, or as
                :meth:`run` (any row's last position counts; nothing written).
            MemoryError, RuntimeError: as :meth:`run` (the steps before the failing one did run).
        """
        if not 0 < n <= self._keep[1].shape[0] or steps < 1:
            raise ValueError(f"DecodeGraph.run_steps: {n} rows x {steps} steps, the buffers hold "
                             f"{self._keep[1].shape[0]} rows")
        if temperatures is not None and (temperatures.dtype != torch.float32 or temperatures.shape != (n,)
                                         or log_noise is None or log_noise.dtype != torch.float32
                                         or log_noise.shape != (steps, n, self.vocab) or not log_noise.is_contiguous()):
            raise ValueError(f"DecodeGraph.run_steps: temperatures [{n}] float32 need log_noise [{steps}, {n}, "
                             f"{self.vocab}] float32 contiguous")
        if top_ks is not None and (temperatures is None or top_ks.dtype != torch.int32 or top_ks.shape != (n,)):
            raise ValueError(f"DecodeGraph.run_steps: top_ks must be [{n}] int32, with temperatures")
        self._ensure_positions(min(max_seq_len + steps - 1, self.max_positions))
        logits = torch.empty(n, self.vocab, dtype=torch.float32)
        tokens = torch.empty(steps, n, dtype=torch.int64)
        stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.int64)
        flag = interrupt if interrupt is not None else ctypes.c_int32(0)
        done = _i64(0)
        temps = temperatures.contiguous() if temperatures is not None else None
        ks = top_ks.contiguous() if top_ks is not None else None
        rc = self._steps(self.stack.c_model, ctypes.byref(self._graph), n, steps,
                         temps.data_ptr() if temps is not None else None, ks.data_ptr() if ks is not None else None,
                         log_noise.data_ptr() if temps is not None else None, stops.data_ptr(), stops.numel(),
                         ctypes.byref(flag), logits.data_ptr(), tokens.data_ptr(), ctypes.byref(done))
        self._check(rc, "run_steps")
        return tokens[:done.value]

    def _check(self, rc: int, name: str) -> None:
        if rc == -3:
            raise ValueError(f"DecodeGraph.{name}: a token id, context length or block id is out of range")
        if rc:
            self.stack.raise_for(rc)
