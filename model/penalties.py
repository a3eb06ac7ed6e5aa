"""``min_tokens``, logit bias and the repetition, frequency and presence penalties: one row of logits changed
by what the request has seen, before any token is picked from it.

In the order of vLLM's sampler (``vllm/v1/sample/sampler.py``): ``min_tokens`` and the bias first, then the
penalties::

    logits[t] = -inf                                             for each stop token t, while the output is
                                                                 shorter than min_tokens (EOS unless ignored,
                                                                 stop_token_ids)
    logits[t] += logit_bias[t]                                   for each biased token t
    logits[t] = logits[t] / r if logits[t] > 0 else logits[t] * r  for each t in prompt or output (r: repetition)
    logits -= frequency_penalty * count                          count[t]: times t occurs in the output so far
    logits -= presence_penalty * (count > 0)

The repetition penalty is the CTRL paper's (Keskar et al., 2019; ``transformers``'
``RepetitionPenaltyLogitsProcessor``) over prompt and output; frequency and presence are OpenAI's, over the
output only. Log-probabilities stay those of the raw logits (:func:`model.sampling.token_logprobs`), as
vLLM reports by default.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

import torch


class SamplingParams(Protocol):
    """The fields of :class:`model.sampling.SamplingParams` read here (that module imports this one)."""

    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: tuple[tuple[int, float], ...]
    min_tokens: int
    max_tokens: int

PENALTY_BOUND = 2.0            # |presence_penalty|, |frequency_penalty| at most this (OpenAI's range)
LOGIT_BIAS_BOUND = 100.0       # |bias| at most this (OpenAI's range)
MAX_LOGIT_BIAS = 1024          # biased tokens of one request: every message that forwards them stays small


def penalize(logits: torch.Tensor, p: SamplingParams, prompt_ids: Sequence[int], output_ids: Sequence[int],
             stop_ids: Collection[int] = ()) -> torch.Tensor:
    """``[vocab]`` logits of one row after ``p``'s logit bias and penalties (module docstring), as a new
    float32 tensor on the logits' device; ``logits`` is not changed.

    Args:
        logits: ``[vocab]`` float logits of the position being sampled.
        p: the request's parameters (its ``logit_bias`` token ids inside the vocabulary: validated).
        prompt_ids: the request's prompt (repetition penalty only).
        output_ids: the tokens generated before this position (all three penalties, ``min_tokens``).
        stop_ids: the tokens that end the request (``min_tokens``): :meth:`SamplingParams.stop_ids`.
    """
    out = logits.float().clone()
    device, vocab = out.device, out.shape[-1]
    if len(output_ids) < p.min_tokens and stop_ids:
        out[torch.tensor(sorted(stop_ids), device=device)] = -torch.inf
    if p.logit_bias:
        ids, bias = zip(*p.logit_bias)
        out.index_add_(0, torch.tensor(ids, device=device), torch.tensor(bias, dtype=torch.float32, device=device))
    if p.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        for ids in (prompt_ids, output_ids):
            if len(ids):
                seen[torch.as_tensor(list(ids), device=device)] = True
        out = torch.where(seen, torch.where(out > 0, out / p.repetition_penalty, out * p.repetition_penalty), out)
    if (p.frequency_penalty or p.presence_penalty) and len(output_ids):
        counts = torch.bincount(torch.as_tensor(list(output_ids), device=device), minlength=vocab).float()
        out -= p.frequency_penalty * counts
        out -= p.presence_penalty * (counts > 0).float()
    return out


def check_penalties(p: SamplingParams, vocab_size: int) -> None:
    """Raise ``ValueError`` naming the first of ``p``'s bias or penalty fields out of range: ``min_tokens``
    outside [0, max_tokens]; presence and
    frequency penalties not finite in [-2, 2]; a repetition penalty not finite and positive; more than
    :data:`MAX_LOGIT_BIAS` biased tokens, one outside the vocabulary or repeated, or a bias not finite in
    [-100, 100]."""
    if not 0 <= p.min_tokens <= p.max_tokens:
        raise ValueError(f"min_tokens must be in [0, max_tokens={p.max_tokens}], got {p.min_tokens}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        if not -PENALTY_BOUND <= value <= PENALTY_BOUND:       # NaN fails too
            raise ValueError(f"{name} must be in [-{PENALTY_BOUND:g}, {PENALTY_BOUND:g}], got {value}")
    if not 0 < p.repetition_penalty < float("inf"):
        raise ValueError(f"repetition_penalty must be a finite number > 0 (1 is off), got {p.repetition_penalty}")
    if len(p.logit_bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias of {len(p.logit_bias)} tokens; at most {MAX_LOGIT_BIAS} are allowed")
    ids = [t for t, _ in p.logit_bias]
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"logit_bias token ids {bad[:8]} are outside the vocabulary [0, {vocab_size})")
    if len(set(ids)) != len(ids):
        raise ValueError("logit_bias repeats a token id")
    wild = [b for _, b in p.logit_bias if not -LOGIT_BIAS_BOUND <= b <= LOGIT_BIAS_BOUND]
    if wild:
        raise ValueError(f"logit_bias values must be in [-{LOGIT_BIAS_BOUND:g}, {LOGIT_BIAS_BOUND:g}], got {wild[0]}")
