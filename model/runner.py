"""Runs one forward step of the model over a batch of sequences on a paged KV cache."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.kernels.paged_attention import build_attention_metadata
from pdserve.model.kv_cache import KVCacheSpec
from pdserve.model.llama import LlamaForCausalLM


@dataclass(frozen=True)
class StepInput:
    """One sequence's share of a forward step.

    Attributes:
        token_ids: the new tokens to run (a prompt, a prompt chunk, or one decode token).
        num_computed: tokens of this sequence already in the cache before this step.
        block_table: the sequence's block ids, enough for ``num_computed + len(token_ids)`` tokens.
    """

    token_ids: list[int]
    num_computed: int
    block_table: list[int]


class ModelRunner:
    """Owns the KV cache tensor and runs batched forward steps on it, on ``device`` (default: the
    device of the model's weights)."""

    def __init__(self, model: LlamaForCausalLM, spec: KVCacheSpec, device: torch.device | str | None = None) -> None:
        if device is None:
            device = next(model.parameters()).device
        self.model, self.spec, self.device = model, spec, device
        self.kv_cache = spec.allocate(device)
        # queries in the cache's dtype: a step's metadata may skip the torch attention path's gather indices
        self._head_dim = spec.head_dim if model.embed_tokens.weight.dtype == spec.dtype else None

    def run(self, batch: list[StepInput], all_logits: bool = False, num_layers: int | None = None) -> torch.Tensor:
        """Run the step and return float32 logits: ``[len(batch), vocab]`` of each sequence's last
        new token, or with ``all_logits`` ``[num_tokens, vocab]`` of every new token (speculative
        verification). ``num_layers`` runs only the first layers (self-draft).

        Raises:
            ValueError: empty batch, empty sequence or a block table too short.
        """
        hidden, query_lens = self._hidden(batch, num_layers)
        if all_logits:
            return self.model.compute_logits(hidden)
        last_rows = torch.tensor(query_lens, device=self.device).cumsum(0) - 1
        return self.model.compute_logits(hidden[last_rows])

    def run_with_rows(self, batch: list[StepInput], whole: Sequence[bool]
                      ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """As :meth:`run`: float32 logits ``[len(batch), vocab]`` of each sequence's last new token; and for each
        sequence ``i`` with ``whole[i]``, the logits of all its new tokens ``[len(token_ids), vocab]`` (a prompt's
        log-probabilities), None for the others.

        Raises:
            ValueError: as :meth:`run`.
        """
        hidden, query_lens = self._hidden(batch, None)
        ends = torch.tensor(query_lens).cumsum(0).tolist()
        last = self.model.compute_logits(hidden[torch.tensor(ends, device=self.device) - 1])
        rows = [self.model.compute_logits(hidden[end - q:end]) if want else None
                for end, q, want in zip(ends, query_lens, whole)]
        return last, rows

    def _hidden(self, batch: list[StepInput], num_layers: int | None) -> tuple[torch.Tensor, list[int]]:
        """The last layer's hidden states of every new token of the step ``[num_tokens, hidden]``, and each
        sequence's number of new tokens."""
        if not batch or any(not s.token_ids for s in batch):
            raise ValueError("a step needs at least one sequence, each with at least one token")
        query_lens = [len(s.token_ids) for s in batch]
        meta = build_attention_metadata(
            query_lens, [s.num_computed + q for s, q in zip(batch, query_lens)],
            [s.block_table for s in batch], self.spec.block_size, self.device, self.kv_cache.dtype, self._head_dim)
        input_ids = torch.tensor([t for s in batch for t in s.token_ids], dtype=torch.long, device=self.device)
        return self.model(input_ids, meta, self.kv_cache, num_layers), query_lens
