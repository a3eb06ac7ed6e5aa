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
from dataclasses import dataclass

import torch

from pdserve.kernels.cpu.fused import argmax_rows, vectorized
from pdserve.model.penalties import check_penalties, penalize_rows_
from pdserve.model.structured import KINDS, Constraint

_MASK63 = (1 << 63) - 1
MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 1024  # stop tokens of one request: every message that forwards them stays small
MAX_GRAMMAR_AFTER = 16     # token ids of the marker that starts a grammar (a reasoning model's `</think>`)
MAX_CACHE_SALT_CHARS = 256
GREEDY_BELOW = 1e-5
"""Temperatures under this sample greedily: logits divided by a temperature near 0 overflow float32 to
infinity (at 1e-38, any logit above ~3.4), and the draw then picks whichever infinite logit comes
first, not the most likely token. vLLM takes the same threshold (``_SAMPLING_EPS``) for greedy."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each output token of one request.

    Attributes:
        temperature: 0 for greedy (as is any value under :data:`GREEDY_BELOW`, made 0 here); otherwise
            logits are divided by it.
        top_k: keep the k most likely tokens; 0 keeps all.
        top_p: keep the smallest set of tokens whose probability reaches top_p, in (0, 1].
        min_p: drop the tokens whose probability (after temperature) is under ``min_p`` times the likeliest
            token's, in [0, 1]; 0 is off (min-p sampling, Nguyen et al. 2024, as vLLM applies it: before top-k
            and top-p).
        seed: seeds the request's noise (the router fills one in when the client gives none).
        max_tokens: output tokens to generate at most (>= 1).
        stop_token_ids: tokens that end the request (the stop token is part of the output), at most
            :data:`MAX_STOP_TOKEN_IDS`.
        ignore_eos: do not stop at the model's EOS tokens.
        logprobs: None computes no log-probabilities; k >= 0 returns the sampled token's and the
            k most likely tokens' (:func:`token_logprobs`), at most :data:`MAX_LOGPROBS`.
        presence_penalty, frequency_penalty: subtracted from the logit of each token the output holds, once
            and per occurrence, in [-2, 2] (OpenAI's); 0 is off.
        repetition_penalty: divides the positive logits of tokens in prompt or output and multiplies the
            negative ones, in [0.01, 100] (CTRL's, as ``transformers`` and vLLM take it); 1 is off.
        logit_bias: ``(token id, bias)`` pairs, biases in [-100, 100] added to those logits; at most
            :data:`model.penalties.MAX_LOGIT_BIAS`.
        min_tokens: output tokens before any stop token (EOS unless ignored, ``stop_token_ids``) may be picked,
            in [0, max_tokens] (vLLM's). All five: :mod:`model.penalties`.
        prompt_logprobs: None computes none; k >= 0 returns each prompt token's log-probability given the
            tokens before it, with the k most likely tokens there (:func:`prompt_logprobs`), at most
            :data:`MAX_LOGPROBS`; the worker that prefills such a prompt runs all of it (no prefix cache).
        grammar: structured output, ``("json_object", "")`` or ``("json_schema", schema text)``
            (:mod:`model.structured`): each token is sampled from those the grammar allows next; not with
            ``ignore_eos`` or ``min_tokens`` (the grammar's end allows only stop tokens).
        bad_words: token sequences the output may not contain (vLLM's ``bad_words``, each word as the router
            tokenizes it): a sequence's last token is forbidden where the output ends with the tokens before it.
        allowed_token_ids: when given, the only tokens that may be picked (vLLM's). Both with the penalties:
            :mod:`model.penalties`.
        priority: the request's scheduling order on the workers (vLLM's ``priority``: lower first, ties in
            arrival order), carried here as every per-request setting the workers read; no effect on sampling.
        cache_salt: the request's prefix-cache salt (vLLM's ``cache_salt``): it reuses only KV cached under the
            same salt (:mod:`prefill_worker.prefix_cache`); "" for none. At most :data:`MAX_CACHE_SALT_CHARS`.
        grammar_after: token ids that start the grammar (:class:`model.structured.Constraint`'s ``start_after``:
            a reasoning model's end of thinking); empty: the grammar holds the whole answer. At most
            :data:`MAX_GRAMMAR_AFTER`, only with a ``grammar``.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    grammar: tuple[str, str] | None = None
    min_p: float = 0.0
    grammar_after: tuple[int, ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    priority: int = 0
    cache_salt: str = ""

    def __post_init__(self) -> None:
        if 0 < self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)

    def validate(self, vocab_size: int) -> None:
        """Raise ``ValueError`` naming the first invalid field."""
        if math.isnan(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if math.isnan(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if math.isnan(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if self.grammar is not None:
            if self.grammar[0] not in KINDS:
                raise ValueError(f"unknown structured output kind {self.grammar[0]!r}")
            if self.ignore_eos or self.min_tokens:
                raise ValueError("structured output cannot be combined with ignore_eos or min_tokens (a grammar "
                                 "ends its answer with a stop token)")
            if self.bad_words or self.allowed_token_ids:
                raise ValueError("structured output cannot be combined with bad_words or allowed_token_ids (a "
                                 "grammar chooses the tokens; those could forbid every one it allows)")
        if self.grammar_after:
            if self.grammar is None:
                raise ValueError("structured_output.start_after needs a structured output kind")
            if len(self.grammar_after) > MAX_GRAMMAR_AFTER:
                raise ValueError(f"structured_output.start_after holds {len(self.grammar_after)} token ids; at most "
                                 f"{MAX_GRAMMAR_AFTER}")
            bad = [t for t in self.grammar_after if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"structured_output.start_after ids {bad} are outside the vocabulary "
                                 f"[0, {vocab_size})")
        if len(self.cache_salt) > MAX_CACHE_SALT_CHARS:
            raise ValueError(f"cache_salt of {len(self.cache_salt)} characters exceeds {MAX_CACHE_SALT_CHARS}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"{len(self.stop_token_ids)} stop_token_ids; at most {MAX_STOP_TOKEN_IDS} are allowed")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")
        check_penalties(self, vocab_size)

    @property
    def penalized(self) -> bool:
        """Whether ``min_tokens``, a logit bias, a penalty, bad words or allowed tokens change the logits: picking
        a token then needs the request's :data:`History` (:func:`sample`'s ``histories``)."""
        return bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0 \
            or self.repetition_penalty != 1 or self.min_tokens > 0 or bool(self.bad_words or self.allowed_token_ids)

    @property
    def constrained(self) -> bool:
        """Whether a grammar holds the answer (:attr:`grammar`): each token then needs the request's
        :class:`model.structured.Constraint`, one step at a time."""
        return self.grammar is not None

    def stop_ids(self, eos_token_ids: tuple[int, ...]) -> frozenset[int]:
        """Every token id that ends this request."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else frozenset(eos_token_ids))


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


@dataclass(frozen=True)
class TokenLogprobs:
    """One output token's log-probability and the ``k`` most likely alternatives (most likely first); ``rank``:
    how many tokens of the vocabulary are at least as likely, itself included (vLLM's rank: 1 for the likeliest
    one; 0: not computed)."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    rank: int = 0


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
