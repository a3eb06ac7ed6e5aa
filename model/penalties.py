"""``allowed_token_ids``, ``bad_words``, ``min_tokens``, logit bias and the repetition, frequency and presence
penalties: one row of logits changed by what the request has seen, before any token is picked from it.

In the order of vLLM's sampler (``vllm/v1/sample/sampler.py``): the allowed tokens and the bad words first, then
``min_tokens`` and the bias, then the penalties::

    logits[t] = -inf                                             for each t not in allowed_token_ids (when given)
    logits[t] = -inf                                             for each bad word (token sequence) w whose
                                                                 tokens but the last end the output so far,
                                                                 t its last (a one-token word: always)
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

import itertools
from collections.abc import Collection, Sequence

import numpy as np
import torch

from pdserve.model.sampling_types import SamplingParams


def penalize(logits: torch.Tensor, p: SamplingParams, prompt_ids: Sequence[int], output_ids: Sequence[int],
             stop_ids: Collection[int] = ()) -> torch.Tensor:
    """``[vocab]`` logits of one row after ``p``'s ``min_tokens``, logit bias and penalties (module docstring),
    as a new float32 tensor on the logits' device; ``logits`` is not changed.

    Args:
        logits: ``[vocab]`` float logits of the position being sampled.
        p: the request's parameters (its ``logit_bias`` token ids inside the vocabulary: validated).
        prompt_ids: the request's prompt (repetition penalty only).
        output_ids: the tokens generated before this position (all three penalties, ``min_tokens``).
        stop_ids: the tokens that end the request (``min_tokens``): :meth:`SamplingParams.stop_ids`.
    """
    return penalize_rows_(logits.float().clone().unsqueeze(0), [p], [(prompt_ids, output_ids, stop_ids)])[0]


def penalize_rows_(out: torch.Tensor, params: Sequence[SamplingParams],
                   histories: Sequence[tuple[Sequence[int], Sequence[int], Collection[int]]]) -> torch.Tensor:
    """:func:`penalize` for ``R`` rows at once, in place: ``out`` ``[R, vocab]`` float32 contiguous logits,
    each row's parameters and its ``(prompt ids, output ids, stop ids)`` (the prompt's may be given as an
    int64 tensor of its distinct ids, computed once per request); returns ``out``. Each adjustment
    gathers the entries it changes (the distinct ``(row, token)`` pairs of the ids concerned, counted once
    for all rows), changes them and scatters them back: the work follows the histories' length, not the
    vocabulary's. A row's result does not depend on the others."""
    flat, vocab = out.view(-1), out.shape[1]
    for row, p in enumerate(params):
        if p.allowed_token_ids:
            allowed = torch.tensor(p.allowed_token_ids, dtype=torch.long, device=out.device)
            kept = out[row, allowed]
            out[row] = -torch.inf
            out[row, allowed] = kept
    banned = [_banned(p.bad_words, h[1]) if p.bad_words else () for p, h in zip(params, histories)]
    if any(banned):
        flat[_keys(banned, vocab, out.device)] = -torch.inf
    stops = [sorted(h[2]) if len(h[1]) < p.min_tokens else () for p, h in zip(params, histories)]
    if any(stops):
        flat[_keys(stops, vocab, out.device)] = -torch.inf
    if any(p.logit_bias for p in params):                     # ids distinct within a row (validated)
        keys = _keys([[t for t, _ in p.logit_bias] for p in params], vocab, out.device)
        flat[keys] += torch.tensor([b for p in params for _, b in p.logit_bias], dtype=torch.float32,
                                   device=out.device)
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = [(h[0], h[1]) if p.repetition_penalty != 1.0 else ((), ()) for p, h in zip(params, histories)]
        keys = torch.unique(torch.cat([_keys([s[0] for s in seen], vocab, out.device),
                                       _keys([s[1] for s in seen], vocab, out.device)]))
        r = _per_row([p.repetition_penalty for p in params], keys // vocab, out.device)
        v = flat[keys]
        flat[keys] = torch.where(v > 0, v / r, v * r)
    outputs = [h[1] if p.frequency_penalty or p.presence_penalty else () for p, h in zip(params, histories)]
    if any(outputs):
        keys, counts = torch.unique(_keys(outputs, vocab, out.device), return_counts=True)
        rows = keys // vocab
        v = flat[keys] - _per_row([p.frequency_penalty for p in params], rows, out.device) * counts.float()
        flat[keys] = v - _per_row([p.presence_penalty for p in params], rows, out.device)
    return out


def _banned(bad_words: Sequence[Sequence[int]], output_ids: Sequence[int]) -> list[int]:
    """The tokens ``bad_words`` forbid next after ``output_ids``: each word's last token where the output ends
    with the tokens before it (vLLM's ``apply_bad_words``, over the output only)."""
    out = set()
    for word in bad_words:
        n = len(word) - 1
        if n == 0 or len(output_ids) >= n and list(output_ids[len(output_ids) - n:]) == list(word[:n]):
            out.add(word[-1])
    return sorted(out)


def _keys(ids: Sequence[Sequence[int] | torch.Tensor], vocab: int, device: torch.device) -> torch.Tensor:
    """``row * vocab + token`` for each id of each row's ids, a list or an int64 tensor (int64, on ``device``)."""
    lengths = [len(x) for x in ids]
    rows = torch.repeat_interleave(torch.arange(len(ids)), torch.tensor(lengths))
    if not any(isinstance(x, torch.Tensor) for x in ids):
        tokens = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=sum(lengths)))
    else:                                                     # (np.fromiter: torch.tensor of a list is slower)
        tokens = torch.cat([x.cpu() if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.long)
                            for x in ids])
    return (rows * vocab + tokens).to(device)


def _per_row(values: Sequence[float], rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``values[row]`` for each entry of ``rows``, float32."""
    return torch.tensor(values, dtype=torch.float32, device=device)[rows]
