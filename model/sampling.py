"""Sampling parameters and the batched sampler.

Randomness is reproducible and independent of batching or of which worker
samples: the noise for output token ``i`` of a request comes from a generator
seeded with ``mix(seed, i)``, so the prefill worker (token 0) and the decode
worker (tokens 1..) draw from one deterministic sequence. Sampling uses the
exponential race (``argmax(p / E)``, ``E ~ Exp(1)``), which draws exactly from ``p``.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

import torch

from pdserve.kernels.cpu.fused import argmax_rows, vectorized
from pdserve.model.penalties import penalize_rows_
from pdserve.model.sampling_types import SamplingParams, TokenLogprobs
from pdserve.model.structured import Constraint

_MASK63 = (1 << 63) - 1


def request_generator(seed: int, output_index: int, stream: int = 0) -> torch.Generator:
    """The generator for output token ``output_index`` of a request seeded with ``seed``;
    ``stream`` separates independent draws for the same token (e.g. speculative acceptance)."""
    mixed = (seed * 6364136223846793005 + (output_index + 1) * 1442695040888963407
             + stream * 0x9E3779B97F4A7C15) & _MASK63
    return torch.Generator().manual_seed(mixed)


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """``[vocab]`` logits -> ``[vocab]`` float32 probabilities after temperature, min-p, top-k and top-p.

    Greedy (temperature 0) gives a one-hot distribution at the argmax.
    """
    if p.temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(), logits.shape[-1]).float()
    scaled = logits.float() / p.temperature
    if 0 < p.top_k < scaled.shape[0]:
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    probs = torch.softmax(scaled, dim=-1)
    if p.min_p > 0:     # top-k keeps the likeliest token, so dropping after it drops what dropping before would
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
    if p.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p   # mass before this token already enough
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    return probs


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from ``probs`` (``[vocab]``, need not sum to 1) by the exponential race. The noise is drawn
    by ``generator`` on the CPU whatever the device of ``probs`` (a request's seeded draws are the same on
    a GPU worker as on a CPU one)."""
    noise = torch.empty(probs.shape, dtype=probs.dtype).exponential_(generator=generator)
    return int((probs / noise.to(probs.device)).argmax())


def log_space(p: SamplingParams) -> bool:
    """Whether ``p`` samples (temperature > 0) with no top-p or min-p cut: such rows draw by
    :func:`temperature_draw` (top-k, if any, applied there), the rule the multi-step C loop also runs."""
    return p.temperature != 0 and p.top_p == 1 and p.min_p == 0


def log_noise(seed: int, index: int, vocab: int) -> torch.Tensor:
    """``log E`` for the exponential race of output token ``index`` of a request seeded with ``seed``:
    ``[vocab]`` float32, ``E`` the same draws :func:`draw` makes (so ``-log E`` is Gumbel noise)."""
    return torch.empty(vocab).exponential_(generator=request_generator(seed, index)).log_()


def temperature_draw(logits: torch.Tensor, temperature: float, noise: torch.Tensor, top_k: int = 0) -> int:
    """The exponential race of :func:`draw` over :func:`filtered_probs` (temperature, top-k; no top-p) in
    log space: ``argmax(scaled - log E)`` with ``scaled = logits / temperature`` and, for ``0 < top_k <
    vocab``, every entry below the k-th largest ``scaled`` set to -inf (``[vocab]`` float32 logits,
    ``noise`` from :func:`log_noise`). The argmax of ``p / E`` and of ``log p - log E`` is the same token,
    and ``log p`` differs from the kept ``scaled`` by a constant, so no softmax is needed (the Gumbel-max
    trick, Gumbel 1954; Maddison et al. 2014). ``decode_stack.c: pd_decode_graph_steps`` computes the
    same float32 operations."""
    scaled = logits.float() / temperature
    if 0 < top_k < scaled.shape[0]:
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    return int((scaled - noise.to(scaled.device)).argmax())


def sample_one(logits: torch.Tensor, p: SamplingParams, index: int) -> int:
    """The token of ``[vocab]`` logits for output token ``index`` of a request sampling with ``p``
    (temperature > 0): :func:`temperature_draw` without a top-p or min-p cut, else the exponential race over
    :func:`filtered_probs`. Both draw exactly from the filtered distribution."""
    if log_space(p):
        return temperature_draw(logits, p.temperature, log_noise(p.seed, index, logits.shape[-1]), p.top_k)
    return draw(filtered_probs(logits, p), request_generator(p.seed, index))


GREEDY_C_MIN = 8192   # logits from which the C argmax wins over its call overhead (Zen 4: 1 x 2,048: C 4.1 us,
                      # torch 3.4; 32 x 2,048: 8.6 vs 59; 32 x 128,256: 0.33 vs 3.4 ms)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` (``[B, vocab]`` -> int64 ``[B]``, the same indices), by the AVX-512 kernel
    (:func:`kernels.cpu.fused.argmax_rows`) for float32 CPU logits of at least ``GREEDY_C_MIN`` entries
    where it runs."""
    if logits.dtype == torch.float32 and logits.dim() == 2 and logits.device.type == "cpu" \
            and logits.stride(1) == 1 and logits.numel() >= GREEDY_C_MIN and vectorized():
        return argmax_rows(logits)
    return logits.argmax(dim=-1)


History = tuple[Sequence[int], Sequence[int], Collection[int]]
"""A request's prompt token ids, the output ids before the position being sampled, and the token ids that
end it (:meth:`SamplingParams.stop_ids`)."""


def sample(logits: torch.Tensor, params: list[SamplingParams], output_indexes: list[int],
           histories: Sequence[History | None] | None = None,
           constraints: Sequence[Constraint | None] | None = None) -> list[int]:
    """Pick one token per row.

    Args:
        logits: ``[B, vocab]`` float32.
        params: each row's sampling parameters.
        output_indexes: each row's index among its request's output tokens (0 = first token).
        histories: each row's :data:`History`, needed by the rows whose parameters are
            :attr:`~SamplingParams.penalized` (their logits pass :func:`model.penalties.penalize` first).
        constraints: each row's grammar state (:class:`model.structured.Constraint`) or None: a row's logits
            are masked to the tokens its grammar allows next (after the penalties), and the picked token is
            accepted into it.
    Returns:
        ``B`` token ids.
    Raises:
        ValueError: a penalized row without its history.
    """
    tokens = greedy(logits).tolist()
    rows = [row for row, p in enumerate(params) if p.penalized]
    changed: dict[int, torch.Tensor] = {}
    if rows:        # only the penalized rows are copied and changed; their greedy picks are taken again
        penalized = penalized_rows(logits, rows, params, histories)
        for i, (row, token) in enumerate(zip(rows, greedy(penalized).tolist())):
            tokens[row], changed[row] = token, penalized[i]
    for row, c in enumerate(constraints or ()):
        if c is not None:
            changed[row] = c.mask(changed.get(row, logits[row]))
            if params[row].temperature == 0:      # a sampled row's token is drawn below
                tokens[row] = int(changed[row].argmax())
    for row, (p, index) in enumerate(zip(params, output_indexes)):
        if p.temperature != 0:
            tokens[row] = sample_one(changed.get(row, logits[row]), p, index)
    for row, c in enumerate(constraints or ()):
        if c is not None:
            c.accept(tokens[row])
    return tokens


def penalized_rows(logits: torch.Tensor, rows: list[int], params: Sequence[SamplingParams],
                   histories: Sequence[History | None] | None) -> torch.Tensor:
    """``[len(rows), vocab]`` float32: rows ``rows`` of ``[B, vocab]`` ``logits``, copied and passed through
    :func:`model.penalties.penalize_rows_` together (``params`` and ``histories`` indexed by row of ``logits``).

    Raises:
        ValueError: one of those rows without its history.
    """
    if histories is None or any(histories[row] is None for row in rows):
        raise ValueError("a request with logit_bias or penalties needs its token history to be sampled")
    return penalize_rows_(logits[rows].float(), [params[r] for r in rows], [histories[r] for r in rows])


def token_logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprobs]:
    """Log-probabilities of ``tokens`` under ``logits`` (``[B, vocab]``), with each row's top ``ks[row]``.

    The distribution is the model's own, ``log_softmax(logits)`` in float32 before temperature, top-k
    and top-p (vLLM's default, "raw" logprobs), so a greedy and a sampled request report the same
    numbers for the same token. Callers pass only the rows of requests that asked (no cost otherwise).
    """
    if not tokens:
        return []
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked_t = logp.gather(1, torch.tensor(tokens, dtype=torch.long, device=logp.device).unsqueeze(1))
    ranks = (logp >= picked_t).sum(dim=-1).tolist()
    picked = picked_t.squeeze(1).tolist()
    top_k = max(ks)
    if top_k:
        values, ids = logp.topk(top_k, dim=-1)
        values, ids = values.tolist(), ids.tolist()
    out = []
    for row, (lp, k) in enumerate(zip(picked, ks)):
        out.append(TokenLogprobs(lp, tuple(ids[row][:k]), tuple(values[row][:k]), ranks[row]) if k
                   else TokenLogprobs(lp, rank=ranks[row]))
    return out


def prompt_logprobs(logits: torch.Tensor, token_ids: list[int], start: int, k: int) -> list[TokenLogprobs]:
    """Prompt log-probabilities from one chunk's rows: ``logits`` (``[n, vocab]``) are those of prompt positions
    ``start .. start + n - 1`` of ``token_ids`` (the whole prompt), and row ``j`` scores the next prompt token,
    ``token_ids[start + j + 1]``; a row past the prompt's last token (which predicts the first output token)
    gives nothing. Each with its ``k`` most likely tokens (:func:`token_logprobs`)."""
    n = min(logits.shape[0], len(token_ids) - 1 - start)
    if n <= 0:
        return []
    return token_logprobs(logits[:n], token_ids[start + 1:start + 1 + n], [k] * n)
