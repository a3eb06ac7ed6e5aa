"""The decode worker's own prefill chunks: a colocated worker's prompts, and the prompt and output so far of
a request this worker preempted (:mod:`decode_worker.blocks`), prefilled again in chunks mixed into the
decode steps (Sarathi-Serve's stall-free batching: Agrawal et al., OSDI 2024).
"""

from __future__ import annotations

import torch

from pdserve.cluster.lifecycle import RequestState
from pdserve.decode_worker.request import (
    DecodeRequest,
    TokensEvent,
    by_priority,
    constraints,
    histories,
    rows_logprobs,
)
from pdserve.model.runner import StepInput
from pdserve.model.sampling import prompt_logprobs, sample


class LocalPrefill:
    """The decode engine's prefill side (mixed into :class:`~decode_worker.engine.DecodeEngine`, engine
    thread only). Uses the engine's ``runner``, ``_requests`` (admission order), ``_append`` and
    ``_start_decoding``."""

    def _prefill_chunks(self, budget: int) -> list[tuple[DecodeRequest, int]]:
        """Local prompts to advance this step, by priority then oldest first, within ``budget`` tokens (at least
        one token)."""
        chunks = []
        budget = max(budget, 1)
        for req in by_priority(self._requests.values()):
            if req.state is RequestState.PREFILLING and req.block_table and budget > 0:
                n = min(req.num_tokens - req.num_computed, budget)
                chunks.append((req, n))
                budget -= n
        return chunks

    def _mixed_run(self, batch: list[DecodeRequest], chunks: list[tuple[DecodeRequest, int]]) -> None:
        """One forward over decode tokens and prefill chunks together (Sarathi-Serve's
        stall-free batching): decodes go on while long prompts are prefilled."""
        inputs = [StepInput([r.output_ids[-1]], r.num_tokens - 1, r.block_table) for r in batch]
        inputs += [StepInput((r.prompt_ids + r.output_ids)[r.num_computed:r.num_computed + n], r.num_computed,
                             r.block_table) for r, n in chunks]  # output_ids: a migrated request's prior output
        logits = self._forward(inputs, batch, chunks)
        tokens = sample(logits[:len(batch)], [r.sampling for r in batch], [len(r.output_ids) for r in batch],
                        histories(batch), constraints(batch))
        for req, token, logprobs in zip(batch, tokens, rows_logprobs(logits[:len(batch)], batch, tokens)):
            self._append(req, [token], logprobs)
        for row, (req, n) in enumerate(chunks, start=len(batch)):
            req.num_computed += n
            if req.num_computed == req.num_tokens:
                first = sample(logits[row:row + 1], [req.sampling], [len(req.output_ids)], histories([req]),
                               constraints([req]))[0]
                prompt = [req.prompt_logprobs[p] for p in sorted(req.prompt_logprobs)] if not req.output_ids else []
                req.emit(TokensEvent([first], rows_logprobs(logits[row:row + 1], [req], [first])[0], prompt))
                self._start_decoding(req, first)

    def _forward(self, inputs: list[StepInput], batch: list[DecodeRequest],
                 chunks: list[tuple[DecodeRequest, int]]) -> torch.Tensor:
        """The mixed step's forward: the last-token logits of every input; the prompt log-probabilities of the
        chunks of first prefills that ask for them kept on their requests, by position (a prefill preempted
        and run again writes the same positions)."""
        whole = [False] * len(batch) + [r.sampling.prompt_logprobs is not None and not r.output_ids for r, _ in chunks]
        if not any(whole):
            return self.runner.run(inputs)
        logits, rows = self.runner.run_with_rows(inputs, whole)
        for (req, _), row_logits in zip(chunks, rows[len(batch):]):
            if row_logits is not None:
                lps = prompt_logprobs(row_logits, req.prompt_ids, req.num_computed, req.sampling.prompt_logprobs)
                req.prompt_logprobs.update(enumerate(lps, start=req.num_computed + 1))
        return logits
