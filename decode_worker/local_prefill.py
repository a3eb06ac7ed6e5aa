"""The decode worker's own prefill chunks: a colocated worker's prompts, and the prompt and output so far of
a request this worker preempted (:mod:`decode_worker.blocks`), prefilled again in chunks mixed into the
decode steps (Sarathi-Serve's stall-free batching: Agrawal et al., OSDI 2024).
"""

from __future__ import annotations

from pdserve.cluster.lifecycle import RequestState
from pdserve.decode_worker.request import DecodeRequest, TokensEvent, histories, rows_logprobs
from pdserve.model.runner import StepInput
from pdserve.model.sampling import sample


class LocalPrefill:
    """The decode engine's prefill side (mixed into :class:`~decode_worker.engine.DecodeEngine`, engine
    thread only). Uses the engine's ``runner``, ``_requests`` (admission order), ``_append`` and
    ``_start_decoding``."""

    def _prefill_chunks(self, budget: int) -> list[tuple[DecodeRequest, int]]:
        """Local prompts to advance this step, oldest first, within ``budget`` tokens (at least one token)."""
        chunks = []
        budget = max(budget, 1)
        for req in self._requests.values():
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
        logits = self.runner.run(inputs)
        tokens = sample(logits[:len(batch)], [r.sampling for r in batch], [len(r.output_ids) for r in batch],
                        histories(batch))
        for req, token, logprobs in zip(batch, tokens, rows_logprobs(logits[:len(batch)], batch, tokens)):
            self._append(req, [token], logprobs)
        for row, (req, n) in enumerate(chunks, start=len(batch)):
            req.num_computed += n
            if req.num_computed == req.num_tokens:
                first = sample(logits[row:row + 1], [req.sampling], [len(req.output_ids)], histories([req]))[0]
                req.emit(TokensEvent([first], rows_logprobs(logits[row:row + 1], [req], [first])[0]))
                self._start_decoding(req, first)
