"""The decode engine's speculative step: drafts proposed for the batch, verified in one forward of the target,
the accepted prefix kept (Leviathan et al., ICML 2023; Chen et al., 2023), each token's log-probabilities from
the target's logits at its position.
"""

from __future__ import annotations

from pdserve.decode_worker.blocks import covered, grow
from pdserve.decode_worker.request import DecodeRequest, histories
from pdserve.decode_worker.speculative import verify
from pdserve.model.runner import StepInput
from pdserve.model.sampling import TokenLogprobs, token_logprobs


class SpeculativeStep:
    """Mixed into :class:`~decode_worker.engine.DecodeEngine` (engine thread only). Uses the engine's ``cfg``,
    ``runner``, ``proposer``, ``adaptive``, ``pool``, ``spec`` and ``_plain_run``."""

    def _speculative_run(self, batch: list[DecodeRequest]) -> tuple[list[list[int]], list[list[TokenLogprobs] | None]]:
        """Propose, verify all proposals in one forward, keep what the rejection rule accepts. The
        emitted token ``j`` of a request was chosen at verified position ``j``, so its log-probabilities
        come from the target's logits there (row ``j``), whether it was an accepted draft, a resampled
        rejection or the bonus token: the same numbers non-speculative decoding reports. Requests that
        do not draft this step (:class:`AdaptiveSpeculation`) are plain rows; a step where none drafts
        is a plain step."""
        ks = [max(0, min(self.cfg.spec_k, r.sampling.max_tokens - len(r.output_ids) - 1,
                         r.max_context - r.num_tokens - 1)) for r in batch]
        if self.adaptive is not None:
            ks = self.adaptive.plan(batch, ks, self.proposer)
        for r, k in zip(batch, ks):   # blocks for k drafts where the pool has them; fewer drafts where not
            if k:
                grow(self.pool, self.spec, r, r.num_tokens + k)
        ks = [min(k, covered(self.spec, r) - r.num_tokens) for r, k in zip(batch, ks)]   # never past the blocks
        if not any(ks):
            return self._plain_run(batch)
        proposals = self.proposer.propose(batch, ks)
        if not any(p.tokens for p in proposals):
            return self._plain_run(batch)
        logits = self.runner.run([StepInput([r.output_ids[-1], *p.tokens], r.num_tokens - 1, r.block_table)
                                  for r, p in zip(batch, proposals)], all_logits=True)
        rows = logits.split([len(p.tokens) + 1 for p in proposals])
        out, out_logprobs = [], []
        for req, prop, req_rows in zip(batch, proposals, rows):
            tokens = verify(req_rows, prop, req.sampling, len(req.output_ids), histories([req])[0])
            req.num_draft_tokens += len(prop.tokens)
            req.num_accepted_tokens += len(tokens) - 1
            if self.adaptive is not None:
                self.adaptive.observe(req, len(prop.tokens), len(tokens) - 1)
            out.append(tokens)
            k = req.sampling.logprobs
            out_logprobs.append(None if k is None
                                else token_logprobs(req_rows[:len(tokens)], tokens, [k] * len(tokens)))
        return out, out_logprobs
