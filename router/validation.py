"""Turns a raw ``GenerateRequest`` into prompt ids and resolved sampling parameters,
or a ``ValueError`` whose message names the problem (sent as INVALID_ARGUMENT).

``parse_request`` then ``validate`` raise nothing but ``ValueError`` on any input bytes
(fuzzed in ``tests/test_fuzz_validation.py``). Costs are bounded before work is done:
a text prompt longer than any prompt that could fit the context is refused before it is
tokenized, and a token-id prompt longer than the context before its ids are checked.
"""

from __future__ import annotations

import math
import secrets
import unicodedata
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf import message as pb_message
from google.protobuf.unknown_fields import UnknownFieldSet

from pdserve.cluster.rpc_fields import UNSAFE_CATEGORIES, outside_vocabulary
from pdserve.model.config import ModelConfig
from pdserve.model.sampling_types import SamplingParams
from pdserve.model.structured_spec import check_spec
from pdserve.model.tokenizer import Tokenizer
from pdserve.proto import pdserve_pb2
from pdserve.proto.convert import grammar_from_wire
from pdserve.router.slo import Slo
from pdserve.router.stop_strings import check_stop_strings

MAX_REQUEST_ID_CHARS = 256
MAX_PROMPT_LOGPROB_ENTRIES = 65_536   # prompt tokens x (alternatives + 1): all go in one message (~40 bytes each)
MAX_N = 16


@dataclass(frozen=True)
class ValidRequest:
    """A request the cluster can run: ``prompt_ids`` within the vocabulary and, with
    ``sampling.max_tokens``, within the context; finite sampling and SLO values."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    slo: Slo
    queue_timeout_s: float = 0.0
    stop: tuple[str, ...] = ()         # stop strings (router.stop_strings)
    n: int = 1                         # sequences; sequence i samples with seed sampling.seed + i
    skip_special_tokens: bool = True   # False: special tokens' text kept (but the stop tokens'), router-side
    include_stop_str_in_output: bool = False   # the matched stop string / stop token's text kept, router-side


def _unknown_fields(msg: pb_message.Message, path: str = "") -> list[str]:
    """Dotted paths of every unknown field (including known numbers sent with the wrong wire type)."""
    found = [f"{path}#{f.field_number}" for f in UnknownFieldSet(msg)]
    for desc, value in msg.ListFields():
        if desc.message_type is not None and not desc.is_repeated:
            found += _unknown_fields(value, f"{path}{desc.name}.")
    return found


def _truncated(ids: list[int], s: pdserve_pb2.SamplingParams, context: int, default_max_tokens: int) -> list[int]:
    """``ids`` left-truncated by ``truncate_prompt_tokens`` (vLLM's): the last k; for -1, the last
    ``context - max_tokens`` (at least one).

    Raises:
        ValueError: ``truncate_prompt_tokens`` 0 or below -1.
    """
    if not s.HasField("truncate_prompt_tokens"):
        return ids
    k = s.truncate_prompt_tokens
    if k == -1:
        k = max(1, context - (s.max_tokens if s.HasField("max_tokens") else default_max_tokens))
    elif k < 1:
        raise ValueError(f"truncate_prompt_tokens must be -1 or >= 1 (the prompt tokens to keep), got {k}")
    return ids[-k:]


def parse_request(raw: bytes) -> pdserve_pb2.GenerateRequest:
    """Parse wire bytes strictly.

    Raises:
        ValueError: undecodable bytes, or fields the schema does not have (or of the wrong type).
    """
    try:
        req = pdserve_pb2.GenerateRequest.FromString(raw)
    except pb_message.DecodeError as exc:
        raise ValueError(f"malformed GenerateRequest: {exc}") from None
    unknown = _unknown_fields(req)
    if unknown:
        raise ValueError(f"unknown fields or fields of the wrong type in GenerateRequest: {', '.join(unknown)}")
    return req


def printable_id(request_id: str) -> str:
    """``request_id`` safe to write into a log line: control, format and line/paragraph separator
    characters (:data:`cluster.rpc_fields.UNSAFE_CATEGORIES`: newlines, ANSI escapes, bidirectional overrides)
    replaced by their ``\\x..``/``\\u....`` escapes, so a client cannot forge or hide log lines; any
    other text is kept. The router uses (and echoes in ``Final.request_id``) this form."""
    return "".join(c.encode("unicode_escape").decode("ascii") if unicodedata.category(c) in UNSAFE_CATEGORIES else c
                   for c in request_id)


def check_tokenized(ids: list[int], vocab_size: int, tokenizer: Tokenizer) -> None:
    """Refuses ids that the router's own tokenizing of a text (a prompt, a chat template's rendering)
    produced past the model's vocabulary: not the client's ids but a checkpoint whose tokenizer reaches
    past its model (the router warns of it at start).

    Raises:
        ValueError: naming the ids, the vocabulary and the tokenizer's largest id.
    """
    if bad := outside_vocabulary(ids, vocab_size):
        raise ValueError(f"the prompt text tokenizes to ids {bad[:8]} outside the model's vocabulary "
                         f"[0, {vocab_size}): this checkpoint's tokenizer has ids up to {tokenizer.max_token_id}")


MAX_BAD_WORDS = 128            # words of one request (each takes up to two token sequences)
MAX_BAD_WORD_CHARS = 256


def bad_word_ids(words: Sequence[str], tokenizer: Tokenizer) -> tuple[tuple[int, ...], ...]:
    """The token sequences of ``words`` as vLLM forbids them (``SamplingParams.update_from_tokenizer``): each
    word's tokens as it starts a text, and with a leading space, as it falls mid-text, where that spelling
    begins with another token and is as long (so it is the word's other form, not a space token before it).

    Raises:
        ValueError: more than :data:`MAX_BAD_WORDS` words, an empty (or blank) one, or one over
            :data:`MAX_BAD_WORD_CHARS` characters (before tokenizing it).
    """
    if len(words) > MAX_BAD_WORDS:
        raise ValueError(f"{len(words)} bad_words; at most {MAX_BAD_WORDS} are allowed")
    out: list[tuple[int, ...]] = []
    for word in words:
        if not word.strip() or len(word) > MAX_BAD_WORD_CHARS:
            raise ValueError(f"bad_words entries must be 1 to {MAX_BAD_WORD_CHARS} characters, not blank")
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        out.append(plain)
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return tuple(w for w in out if w)


def validate(req: pdserve_pb2.GenerateRequest, cfg: ModelConfig, tokenizer: Tokenizer,
             default_max_tokens: int, default_slo: Slo = Slo(1.0, 0.1),
             max_tokens_limit: int | None = None, priority_scheduling: bool = False) -> ValidRequest:
    """Check a parsed request against the model and the operator's ``max_tokens_limit``
    (``RouterConfig.max_tokens_limit``; None: the context is the only bound).

    The request id is kept as given when printable, else escaped (:func:`printable_id`).

    Raises:
        ValueError: request_id over 256 characters once escaped; empty prompt; text prompt longer than
            :attr:`Tokenizer.max_token_chars` x context; token ids outside the vocabulary; prompt plus
            max_tokens beyond the context; max_tokens above ``max_tokens_limit`` (the message names
            the limit); truncate_prompt_tokens 0 or below -1; invalid sampling parameters (NaN or infinite
            temperature, top_p outside (0, 1], min_p outside [0, 1], negative top_k, max_tokens < 1, stop
            tokens outside the vocabulary or more than :data:`model.sampling_types.MAX_STOP_TOKEN_IDS` of them,
            logprobs or prompt_logprobs outside
            [0, 20], n outside [1, 16], more than 8 stop strings or one empty or over 256 characters,
            penalties or logit_bias out of range: :func:`model.sampling_types.check_penalties`; prompt_logprobs over
            more than :data:`MAX_PROMPT_LOGPROB_ENTRIES` (prompt tokens x (alternatives + 1)); a structured output
            spec :func:`model.structured_spec.check_spec` refuses, or one with ignore_eos or min_tokens); SLOs not
            finite and positive; queue_timeout_s not finite and non-negative; a non-zero priority without
            ``priority_scheduling`` (``--scheduling-policy priority``).
    """
    context = cfg.max_model_len
    if len(req.request_id) > MAX_REQUEST_ID_CHARS:  # before escaping it (escapes only lengthen it)
        raise ValueError(f"request_id of {len(req.request_id)} characters exceeds {MAX_REQUEST_ID_CHARS}")
    request_id = printable_id(req.request_id)  # what the router keeps, logs and echoes: bounded as kept
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise ValueError(f"request_id of {len(request_id)} characters (control characters escaped) exceeds "
                         f"{MAX_REQUEST_ID_CHARS}")
    kind = req.WhichOneof("prompt")
    if kind == "text":
        if not req.text:
            raise ValueError("empty prompt")
        limit = context * tokenizer.max_token_chars
        if len(req.text) > limit:  # tokenizing megabytes would stall the router; it cannot fit anyway
            raise ValueError(f"prompt text of {len(req.text)} characters exceeds the model's context of {context} "
                             f"tokens (no text over {limit} characters fits)")
        ids = tokenizer.encode(req.text)
    elif kind == "token_ids":
        ids = list(req.token_ids.ids)
    else:
        raise ValueError("empty prompt: set `text` or `token_ids`")
    if not ids:
        raise ValueError("empty prompt")
    ids = _truncated(ids, req.sampling, context, default_max_tokens)
    if len(ids) >= context:
        raise ValueError(f"prompt ({len(ids)} tokens) exceeds the model's context of {context} tokens "
                         f"(at most {context - 1} prompt tokens leave room for one output token)")
    if kind == "text":
        check_tokenized(ids, cfg.vocab_size, tokenizer)
    elif bad := outside_vocabulary(ids, cfg.vocab_size):
        raise ValueError(f"token ids {bad[:8]} are outside the vocabulary [0, {cfg.vocab_size})")
    s = req.sampling
    sampling = SamplingParams(
        temperature=s.temperature if s.HasField("temperature") else 1.0,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        min_p=s.min_p if s.HasField("min_p") else 0.0,
        top_k=s.top_k,
        seed=s.seed if s.HasField("seed") else secrets.randbits(63),
        max_tokens=s.max_tokens if s.HasField("max_tokens") else default_max_tokens,
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs if s.HasField("logprobs") else None,
        presence_penalty=s.presence_penalty if s.HasField("presence_penalty") else 0.0,
        frequency_penalty=s.frequency_penalty if s.HasField("frequency_penalty") else 0.0,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
        logit_bias=tuple(sorted(s.logit_bias.items())),
        min_tokens=s.min_tokens,
        prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
        grammar=grammar_from_wire(s.structured_output),
        grammar_after=tuple(s.structured_output.start_after),
        bad_words=bad_word_ids(s.bad_words, tokenizer),
        allowed_token_ids=tuple(s.allowed_token_ids),
        priority=req.priority,
        cache_salt=req.cache_salt,
    )
    if req.priority and not priority_scheduling:
        raise ValueError(f"priority {req.priority} needs a router started with --scheduling-policy priority (this "
                         "one schedules in arrival order)")
    if sampling.prompt_logprobs is not None and len(ids) * (sampling.prompt_logprobs + 1) > MAX_PROMPT_LOGPROB_ENTRIES:
        raise ValueError(f"prompt_logprobs {sampling.prompt_logprobs} over a {len(ids)}-token prompt is "
                         f"{len(ids) * (sampling.prompt_logprobs + 1)} entries, more than the "
                         f"{MAX_PROMPT_LOGPROB_ENTRIES} one message carries (fewer alternatives, or a shorter prompt)")
    if sampling.grammar is not None:
        check_spec(sampling.grammar)
    n = s.n if s.HasField("n") else 1
    if not 1 <= n <= MAX_N:
        raise ValueError(f"n must be in [1, {MAX_N}], got {n}")
    stop = check_stop_strings(s.stop)
    if math.isnan(sampling.temperature) or math.isnan(sampling.top_p) or math.isnan(sampling.min_p):
        raise ValueError("temperature, top_p and min_p must be numbers, not NaN")
    if math.isinf(sampling.temperature):
        raise ValueError(f"temperature must be finite, got {sampling.temperature}")
    sampling.validate(cfg.vocab_size)
    if max_tokens_limit is not None and sampling.max_tokens > max_tokens_limit:
        raise ValueError(f"max_tokens ({sampling.max_tokens}) exceeds this router's limit of {max_tokens_limit} "
                         f"tokens per request (max_tokens_limit)")
    if len(ids) + sampling.max_tokens > cfg.max_model_len:
        raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the "
                         f"model's context of {cfg.max_model_len} tokens")
    slo = Slo(req.ttft_slo_s if req.HasField("ttft_slo_s") else default_slo.ttft_s,
              req.tpot_slo_s if req.HasField("tpot_slo_s") else default_slo.tpot_s)
    checks = (("ttft_slo_s", slo.ttft_s), ("tpot_slo_s", slo.tpot_s), ("queue_timeout_s", req.queue_timeout_s))
    for name, value in checks:
        if not math.isfinite(value) or value < 0 or (value == 0 and name != "queue_timeout_s"):
            kind = "a finite non-negative" if name == "queue_timeout_s" else "a finite positive"
            raise ValueError(f"{name} must be {kind} number of seconds, got {value}")
    return ValidRequest(request_id or uuid.uuid4().hex, ids, sampling, slo, req.queue_timeout_s,
                        stop, n, not s.HasField("skip_special_tokens") or s.skip_special_tokens,
                        s.include_stop_str_in_output)
