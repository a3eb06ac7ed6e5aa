"""Speculative decoding: proposers guess ``k`` tokens, the target verifies them in one
forward over the paged cache, and rejection sampling keeps the output distribution
exactly the target's.

Verification of proposals ``d_1..d_k`` with draft distributions ``q_j`` against the
target's ``p_0..p_k`` (``p_j`` = target distribution after consuming ``d_j``,
``p_0`` after the last accepted token)::

    for j = 1..k:  accept d_j with probability min(1, p_{j-1}(d_j) / q_j(d_j))
                   else: emit a token from norm(max(0, p_{j-1} - q_j)) and stop
    all accepted:  emit a bonus token from p_k

(Leviathan et al., "Fast Inference from Transformers via Speculative Decoding", ICML
2023; Chen et al., "Accelerating LLM Decoding with Speculative Sampling", 2023.)
Deterministic proposals (n-gram lookup) have ``q_j`` one-hot. Greedy requests reduce
to "accept while the proposal is the target's argmax". Rejected positions' KV slots
need no clearing: the request's length decides what attention reads, and the next
step overwrites them.

Proposers:
- :class:`NgramProposer`: prompt lookup (Saxena, "Prompt Lookup Decoding", 2023).
- :class:`SelfDraftProposer`: the target's first N layers plus its head (as in
  Zhang et al., "Draft & Verify", ACL 2024); its KV lands in the target's own cache slots.
- :class:`DraftModelProposer`: a smaller checkpoint with the target's tokenizer, with its
  own cache indexed by the same block ids.

Whether a request drafts at all is decided per request by :class:`AdaptiveSpeculation`
(below the engine's batch-size threshold, ``spec_max_batch_size``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from pdserve.decode_worker.config import DecodeWorkerConfig
from pdserve.decode_worker.request import DecodeRequest
from pdserve.model.kv_cache import KVCacheSpec
from pdserve.model.llama import LlamaForCausalLM
from pdserve.model.penalties import penalize_rows_
from pdserve.model.runner import ModelRunner, StepInput
from pdserve.model.sampling import History, SamplingParams, draw, filtered_probs, request_generator, sample_one

ACCEPT_STREAM, DRAFT_STREAM = 1, 2  # generator streams, apart from the token draws (stream 0)


@dataclass
class Proposal:
    """Draft tokens for one request and, for sampled drafts, their distributions
    (``probs[j]``, ``[vocab]`` float32); ``probs`` is empty for deterministic proposals."""

    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)


class Proposer(Protocol):
    def propose(self, reqs: list[DecodeRequest], ks: list[int]) -> list[Proposal]:
        """At most ``ks[i]`` draft tokens for each request, continuing its tokens so far."""

    def forget(self, req: DecodeRequest) -> None:
        """The request finished (or its accepted length changed): drop per-request state."""


def verify(logits: torch.Tensor, proposal: Proposal, params: SamplingParams, output_index: int,
           history: History | None = None) -> list[int]:
    """Tokens to emit for one request after verification (accepted drafts + one more).

    Args:
        logits: ``[len(proposal.tokens) + 1, vocab]`` target logits at the verified positions.
        proposal: the drafts.
        params: the request's sampling parameters (the target distribution is filtered by them).
        output_index: output index of the first token this step emits (seeds the draws).
        history: the request's prompt, output before this step and stop tokens, needed when ``params`` is
            :attr:`~model.sampling.SamplingParams.penalized`: position ``j``'s logits are penalized over
            that output and drafts ``0 .. j - 1`` (all accepted, or ``j`` is not reached), so that the
            target distribution is the one plain decoding samples.
    Returns:
        Between 1 and ``len(proposal.tokens) + 1`` tokens.
    Raises:
        ValueError: a penalized request without its history.
    """
    if params.penalized:
        if history is None:
            raise ValueError("a request with logit_bias or penalties needs its token history to be verified")
        prompt, output, stops = history
        positions = len(proposal.tokens) + 1
        logits = penalize_rows_(logits.float().clone(), [params] * positions,
                                [(prompt, [*output, *proposal.tokens[:j]], stops) for j in range(positions)])
    out: list[int] = []
    for j, d in enumerate(proposal.tokens):
        index = output_index + j
        if params.temperature == 0:
            best = int(logits[j].argmax())
            out.append(best)
            if best != d:
                return out
            continue
        p = filtered_probs(logits[j], params)
        q = proposal.probs[j] if proposal.probs else \
            torch.nn.functional.one_hot(torch.tensor(d, device=p.device), p.shape[0]).float()
        u = torch.rand((), generator=request_generator(params.seed, index, ACCEPT_STREAM))
        if u * q[d] < p[d]:  # u < min(1, p(d)/q(d)), without dividing by a tiny q
            out.append(d)
            continue
        residual = (p - q).clamp_min(0)
        out.append(draw(residual if residual.sum() > 0 else p, request_generator(params.seed, index)))
        return out
    last = len(proposal.tokens)
    if params.temperature == 0:
        out.append(int(logits[last].argmax()))
    else:
        out.append(sample_one(logits[last], params, output_index + last))   # as plain decoding samples it
    return out


class NgramProposer:
    """Finds the most recent earlier occurrence of the last ``n`` tokens (``n`` from
    ``max_n`` down to ``min_n``) in the request's prompt and output, and proposes what followed."""

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, reqs: list[DecodeRequest], ks: list[int]) -> list[Proposal]:
        return [Proposal(self._lookup(r.prompt_ids + r.output_ids, k)) if k > 0 else Proposal()
                for r, k in zip(reqs, ks)]

    def _lookup(self, tokens: list[int], k: int) -> list[int]:
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):  # most recent first, not the suffix itself
                if tokens[start:start + n] == suffix:
                    return tokens[start + n:start + n + k]
        return []

    def forget(self, req: DecodeRequest) -> None:
        pass


def _draft_loop(runner: ModelRunner, reqs: list[DecodeRequest], ks: list[int], computed: list[int],
                num_layers: int | None) -> list[Proposal]:
    """Autoregressive drafting: each round feeds every still-drafting request the tokens its
    draft cache lacks (one after the first round) and samples the next draft token."""
    seqs = [r.prompt_ids + r.output_ids for r in reqs]
    proposals = [Proposal() for _ in reqs]
    for j in range(max(ks, default=0)):
        active = [i for i, k in enumerate(ks) if j < k]
        logits = runner.run([StepInput(seqs[i][computed[i]:], computed[i], reqs[i].block_table) for i in active],
                            num_layers=num_layers)
        for i, row in zip(active, logits):
            params = reqs[i].sampling
            probs = filtered_probs(row, params)
            index = len(reqs[i].output_ids) + j
            token = int(row.argmax()) if params.temperature == 0 else draw(
                probs, request_generator(params.seed, index, DRAFT_STREAM))
            proposals[i].tokens.append(token)
            if params.temperature != 0:
                proposals[i].probs.append(probs)
            computed[i] = len(seqs[i])
            seqs[i].append(token)
    return proposals


class SelfDraftProposer:
    """Drafts with the target's first ``num_layers`` layers and its LM head, in the target's cache."""

    def __init__(self, runner: ModelRunner, num_layers: int) -> None:
        if not 1 <= num_layers < runner.model.cfg.num_layers:
            raise ValueError(f"self-draft layers must be in [1, {runner.model.cfg.num_layers}), got {num_layers}")
        self.runner, self.num_layers = runner, num_layers

    def propose(self, reqs: list[DecodeRequest], ks: list[int]) -> list[Proposal]:
        # The target's cache holds every layer's KV up to the last token, which is not computed yet.
        return _draft_loop(self.runner, reqs, ks, [r.num_tokens - 1 for r in reqs], self.num_layers)

    def forget(self, req: DecodeRequest) -> None:
        pass


class DraftModelProposer:
    """Drafts with a separate smaller model whose cache mirrors the target's block tables.

    Per request it remembers how many tokens its cache holds; a new request's first
    proposal prefills the draft cache with the prompt.
    """

    def __init__(self, model: LlamaForCausalLM, target_spec: KVCacheSpec) -> None:
        spec = KVCacheSpec.for_model(model.cfg, target_spec.num_blocks, target_spec.block_size, target_spec.dtype)
        self.runner = ModelRunner(model, spec)
        self._computed: dict[str, int] = {}

    def propose(self, reqs: list[DecodeRequest], ks: list[int]) -> list[Proposal]:
        computed = [min(self._computed.get(r.attempt_id, 0), r.num_tokens - 1) for r in reqs]
        proposals = _draft_loop(self.runner, reqs, ks, computed, None)
        for r, c in zip(reqs, computed):
            self._computed[r.attempt_id] = c  # valid up to here; verification decides what stays
        return proposals

    def forget(self, req: DecodeRequest) -> None:
        self._computed.pop(req.attempt_id, None)


@dataclass
class _SpecState:
    """One request's speculation state (see :class:`AdaptiveSpeculation`)."""

    drafting: bool
    interval: int                      # steps between probes while not drafting
    wait: int = 0                      # steps until the next probe
    estimate: float | None = None      # EWMA of accepted / drafted; None before the first observation
    shadow: list[int] = field(default_factory=list)  # an unverified n-gram proposal being checked
    shadow_at: int = 0                 # len(output_ids) when the shadow proposal was made


class AdaptiveSpeculation:
    """Per request: draft only while it pays; stop when acceptance falls, probe, resume when it rises.

    Cost model. A verify step of ``d`` drafts costs about ``1 + c*d`` plain steps and yields ``1 + a*d``
    tokens on average, ``a`` being the request's acceptance (accepted / drafted; a draft counts only after
    all before it were accepted). It pays iff ``a > c``: ``min_acceptance`` is ``c``, the break-even
    acceptance (docs/benchmarks.md: a fully accepted k = 4 step cost about 2.5 plain steps on TinyStories,
    ``c`` ~ 0.375; the default 0.3 sits a little below, since steps at 32% acceptance still paid there).

    The rule (our own; it is neither vLLM's batch-size switch, which ``spec_max_batch_size`` mirrors, nor
    the learned per-step lookahead of SpecDec++ or DISCO, nor transformers' assisted-generation schedule
    that grows/shrinks the number of assistant tokens):

    - ``a`` is an exponentially weighted mean (weight ``weight``) over the request's verify steps of
      accepted / drafted; steps that drafted nothing do not count; the first observation sets it.
    - drafting, ``a < min_acceptance``: stop drafting. The request joins the plain rows (k = 0; a step in
      which no request drafts is an ordinary plain step, through the graph runner).
    - not drafting: every ``interval`` steps probe once; the interval doubles after a probe below
      break-even (up to ``max_interval``) and is reset when drafting resumes. A probe at or above
      break-even that leaves ``a`` below it is repeated at the next step, so consecutive good probes
      turn drafting back on within a few steps (one lucky probe alone does not), where doubling
      intervals had kept a request that turned predictable off for up to ``max_interval`` steps.
    - a probe for a deterministic proposer (n-gram, ``shadow=True``) costs no verification: its proposal
      is kept aside and compared with the tokens plain decoding then emits. A greedy verify accepts ``d_j``
      iff it is the argmax, the token plain decoding emits; a sampled one accepts one-hot ``d_j`` with
      probability ``p(d_j)``, the probability that plain sampling emits it; so the count of leading matches
      is distributed as the accepted count would have been. Shadow-probed requests also start not drafting,
      probing at their first step: a prompt the proposer cannot predict never pays for a verify step. A
      shadow probe that proposes nothing (no n-gram match yet) tells nothing about acceptance and costs
      only the lookup, so it is repeated at the next step rather than after the interval: a request whose
      text turns repetitive is found as soon as the proposer can match it.
      Other proposers (self, draft) start drafting and probe with a real verify step.

    Only which rows draft changes, never what is emitted: greedy output is the same as plain decoding.
    """

    def __init__(self, min_acceptance: float = 0.3, weight: float = 0.3, interval: int = 4,
                 max_interval: int = 32, shadow: bool = True) -> None:
        if not (0 <= min_acceptance <= 1 and 0 < weight <= 1 and 1 <= interval <= max_interval):
            raise ValueError("need 0 <= min_acceptance <= 1, 0 < weight <= 1, 1 <= interval <= max_interval")
        self.min_acceptance, self.weight, self.shadow = min_acceptance, weight, shadow
        self.interval, self.max_interval = interval, max_interval
        self._states: dict[str, _SpecState] = {}

    def state(self, req: DecodeRequest) -> _SpecState:
        st = self._states.get(req.attempt_id)
        if st is None:
            st = self._states[req.attempt_id] = _SpecState(drafting=not self.shadow, interval=self.interval)
        return st

    def plan(self, reqs: list[DecodeRequest], ks: list[int], proposer: Proposer) -> list[int]:
        """The proposal lengths of this step: ``ks[i]`` for the requests that draft (or probe with a real
        verify), 0 for the others. Settles pending shadow probes against the tokens emitted since, and
        makes new ones (with ``proposer``; nothing is verified)."""
        out, shadow_probes = [], []
        for i, (req, k) in enumerate(zip(reqs, ks)):
            st = self.state(req)
            if st.shadow:
                self._settle_shadow(req, st)
            if st.drafting or k == 0:
                out.append(k)
                continue
            out.append(0)
            if st.shadow:
                continue
            st.wait -= 1
            if st.wait <= 0:
                st.wait = st.interval  # a probe that proposes nothing just waits again
                if self.shadow:
                    shadow_probes.append(i)
                else:
                    out[-1] = k
        if shadow_probes:
            props = proposer.propose([reqs[i] for i in shadow_probes], [ks[i] for i in shadow_probes])
            for i, prop in zip(shadow_probes, props):
                st = self._states[reqs[i].attempt_id]
                st.shadow, st.shadow_at = list(prop.tokens), len(reqs[i].output_ids)
                if not st.shadow:  # no match to test: a free probe, so try again next step
                    st.wait = 1
        return out

    def observe(self, req: DecodeRequest, num_drafted: int, num_accepted: int) -> None:
        """A verify step (or a settled shadow probe) of ``num_drafted`` drafts accepted ``num_accepted``."""
        if num_drafted <= 0:
            return
        st = self.state(req)
        rate = num_accepted / num_drafted
        st.estimate = rate if st.estimate is None else st.estimate + self.weight * (rate - st.estimate)
        if st.estimate >= self.min_acceptance:
            st.drafting, st.interval = True, self.interval
        elif st.drafting:  # acceptance fell: plain rows from now on, first probe after one interval
            st.drafting, st.interval, st.wait = False, self.interval, self.interval
        elif rate >= self.min_acceptance:  # a probe that would pay, not yet enough to outweigh the past:
            st.wait = 1                    # probe again at the next step
        else:  # a failed probe: back off
            st.interval = min(2 * st.interval, self.max_interval)
            st.wait = st.interval

    def _settle_shadow(self, req: DecodeRequest, st: _SpecState) -> None:
        emitted = req.output_ids[st.shadow_at:st.shadow_at + len(st.shadow)]
        matched = 0
        while matched < len(emitted) and emitted[matched] == st.shadow[matched]:
            matched += 1
        if matched == len(st.shadow) or matched < len(emitted):  # all matched, or a mismatch seen
            drafted, st.shadow = len(st.shadow), []
            self.observe(req, drafted, matched)

    def forget(self, req: DecodeRequest) -> None:
        self._states.pop(req.attempt_id, None)


def make_proposer(cfg: DecodeWorkerConfig, runner: ModelRunner) -> Proposer | None:
    """The configured speculative proposer, or ``None`` when speculation is off.

    Raises:
        ValueError: a draft model whose vocabulary is not the target's (its token ids would not be the
            target's tokens).
    """
    if cfg.speculative == "ngram":
        return NgramProposer()
    if cfg.speculative == "self":
        return SelfDraftProposer(runner, cfg.spec_draft_layers)
    if cfg.speculative == "draft":
        from pdserve.model.loader import load_model
        draft, _ = load_model(cfg.spec_draft_model, cfg.torch_dtype)
        target_vocab = runner.model.cfg.vocab_size
        if draft.cfg.vocab_size != target_vocab:
            raise ValueError(f"draft model {cfg.spec_draft_model}: vocab_size {draft.cfg.vocab_size} is not the "
                             f"target's {target_vocab}; a draft model must share the target's tokenizer")
        return DraftModelProposer(draft, runner.spec)
    return None
