"""What a request asks of sampling, and the log-probability record it gets back: the types and limits that the
router, the wire and the workers share, without torch (:mod:`model.sampling` samples with them). A router
validates a request against these limits and never imports the sampler.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.model.structured_spec import KINDS

MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 1024  # stop tokens of one request: every message that forwards them stays small
MAX_GRAMMAR_AFTER = 16     # token ids of the marker that starts a grammar (a reasoning model's `</think>`)
MAX_CACHE_SALT_CHARS = 256
GREEDY_BELOW = 1e-5
"""Temperatures under this sample greedily: logits divided by a temperature near 0 overflow float32 to
infinity (at 1e-38, any logit above ~3.4), and the draw then picks whichever infinite logit comes
first, not the most likely token. vLLM takes the same threshold (``_SAMPLING_EPS``) for greedy."""

PENALTY_BOUND = 2.0            # |presence_penalty|, |frequency_penalty| at most this (OpenAI's range)
LOGIT_BIAS_BOUND = 100.0       # |bias| at most this (OpenAI's range)
MAX_LOGIT_BIAS = 1024          # biased tokens of one request: every message that forwards them stays small
MAX_ALLOWED_TOKEN_IDS = 4096   # allowed tokens of one request, likewise
MAX_BAD_WORDS = 256            # token sequences of one request's bad words (each word's spellings)
MAX_BAD_WORD_TOKENS = 64       # tokens of one such sequence
# a repetition penalty of 1e-40 turned positive logits into +inf; 0.01 as float32 rounds it (the wire's width)
REPETITION_BOUNDS = (struct.unpack("f", struct.pack("f", 0.01))[0], 100.0)


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
            k most likely tokens' (:func:`model.sampling.token_logprobs`), at most :data:`MAX_LOGPROBS`.
        presence_penalty, frequency_penalty: subtracted from the logit of each token the output holds, once
            and per occurrence, in [-2, 2] (OpenAI's); 0 is off.
        repetition_penalty: divides the positive logits of tokens in prompt or output and multiplies the
            negative ones, in [0.01, 100] (CTRL's, as ``transformers`` and vLLM take it); 1 is off.
        logit_bias: ``(token id, bias)`` pairs, biases in [-100, 100] added to those logits; at most
            :data:`MAX_LOGIT_BIAS`.
        min_tokens: output tokens before any stop token (EOS unless ignored, ``stop_token_ids``) may be picked,
            in [0, max_tokens] (vLLM's). All five: :mod:`model.penalties`.
        prompt_logprobs: None computes none; k >= 0 returns each prompt token's log-probability given the
            tokens before it, with the k most likely tokens there (:func:`model.sampling.prompt_logprobs`), at most
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
            check_in_vocab("structured_output.start_after ids", self.grammar_after, vocab_size, show=None)
        if len(self.cache_salt) > MAX_CACHE_SALT_CHARS:
            raise ValueError(f"cache_salt of {len(self.cache_salt)} characters exceeds {MAX_CACHE_SALT_CHARS}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"{len(self.stop_token_ids)} stop_token_ids; at most {MAX_STOP_TOKEN_IDS} are allowed")
        check_in_vocab("stop_token_ids", self.stop_token_ids, vocab_size, show=None)
        check_penalties(self, vocab_size)

    @property
    def penalized(self) -> bool:
        """Whether ``min_tokens``, a logit bias, a penalty, bad words or allowed tokens change the logits: picking
        a token then needs the request's :data:`model.sampling.History` (:func:`model.sampling.sample`'s
        ``histories``)."""
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


@dataclass(frozen=True)
class TokenLogprobs:
    """One output token's log-probability and the ``k`` most likely alternatives (most likely first); ``rank``:
    how many tokens of the vocabulary are at least as likely, itself included (vLLM's rank: 1 for the likeliest
    one; 0: not computed)."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    rank: int = 0


def check_in_vocab(what: str, ids: Sequence[int], vocab_size: int, show: int | None = 8) -> None:
    """Raise ``ValueError`` naming ``what`` and the first ``show`` of ``ids`` (all with ``None``) outside
    ``[0, vocab_size)``."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{what} {bad[:show]} are outside the vocabulary [0, {vocab_size})")


def check_penalties(p: SamplingParams, vocab_size: int) -> None:
    """Raise ``ValueError`` naming the first of ``p``'s bias or penalty fields out of range: ``min_tokens``
    outside [0, max_tokens]; presence and frequency penalties not finite in [-2, 2]; a repetition penalty
    outside [0.01, 100]; more than :data:`MAX_LOGIT_BIAS` biased tokens, one outside the vocabulary or
    repeated, or a bias not finite in [-100, 100]; more than :data:`MAX_ALLOWED_TOKEN_IDS` allowed tokens or
    one outside the vocabulary; bad words beyond :data:`MAX_BAD_WORDS` sequences of 1 to
    :data:`MAX_BAD_WORD_TOKENS` tokens, or a token outside the vocabulary."""
    if not 0 <= p.min_tokens <= p.max_tokens:
        raise ValueError(f"min_tokens must be in [0, max_tokens={p.max_tokens}], got {p.min_tokens}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        if not -PENALTY_BOUND <= value <= PENALTY_BOUND:       # NaN fails too
            raise ValueError(f"{name} must be in [-{PENALTY_BOUND:g}, {PENALTY_BOUND:g}], got {value}")
    if not REPETITION_BOUNDS[0] <= p.repetition_penalty <= REPETITION_BOUNDS[1]:   # NaN fails too
        raise ValueError(f"repetition_penalty must be in [{REPETITION_BOUNDS[0]:g}, {REPETITION_BOUNDS[1]:g}] (1 is "
                         f"off), got {p.repetition_penalty}")
    if len(p.logit_bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias of {len(p.logit_bias)} tokens; at most {MAX_LOGIT_BIAS} are allowed")
    ids = [t for t, _ in p.logit_bias]
    check_in_vocab("logit_bias token ids", ids, vocab_size)
    if len(set(ids)) != len(ids):
        raise ValueError("logit_bias repeats a token id")
    wild = [b for _, b in p.logit_bias if not -LOGIT_BIAS_BOUND <= b <= LOGIT_BIAS_BOUND]
    if wild:
        raise ValueError(f"logit_bias values must be in [-{LOGIT_BIAS_BOUND:g}, {LOGIT_BIAS_BOUND:g}], got {wild[0]}")
    if len(p.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
        raise ValueError(f"allowed_token_ids holds {len(p.allowed_token_ids)} ids; at most {MAX_ALLOWED_TOKEN_IDS}")
    check_in_vocab("allowed_token_ids", p.allowed_token_ids, vocab_size)
    if len(p.bad_words) > MAX_BAD_WORDS or any(not 0 < len(w) <= MAX_BAD_WORD_TOKENS for w in p.bad_words):
        raise ValueError(f"bad_words: at most {MAX_BAD_WORDS} token sequences of 1 to {MAX_BAD_WORD_TOKENS} tokens")
    check_in_vocab("bad_words token ids", [t for w in p.bad_words for t in w], vocab_size)
