"""Conversions between wire messages and in-process types."""

from __future__ import annotations

import json

from pdserve.model.sampling_types import SamplingParams, TokenLogprobs
from pdserve.proto import pdserve_pb2, worker_pb2

FINISH_REASONS = {
    "stop": pdserve_pb2.FINISH_REASON_STOP,
    "length": pdserve_pb2.FINISH_REASON_LENGTH,
}


def sampling_to_wire(p: SamplingParams) -> worker_pb2.ResolvedSampling:
    return worker_pb2.ResolvedSampling(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed, max_tokens=p.max_tokens,
        stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
        return_logprobs=p.logprobs is not None, num_top_logprobs=p.logprobs or 0,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty, logit_bias=dict(p.logit_bias), min_tokens=p.min_tokens,
        return_prompt_logprobs=p.prompt_logprobs is not None, num_top_prompt_logprobs=p.prompt_logprobs or 0,
        structured_output=grammar_to_wire(p.grammar, p.grammar_after), min_p=p.min_p,
        bad_words=[pdserve_pb2.TokenIds(ids=w) for w in p.bad_words], allowed_token_ids=p.allowed_token_ids,
        priority=p.priority, cache_salt=p.cache_salt)


def sampling_from_wire(m: worker_pb2.ResolvedSampling) -> SamplingParams:
    return SamplingParams(
        temperature=m.temperature, top_p=m.top_p, top_k=m.top_k, seed=m.seed, max_tokens=m.max_tokens,
        stop_token_ids=tuple(m.stop_token_ids), ignore_eos=m.ignore_eos,
        logprobs=m.num_top_logprobs if m.return_logprobs else None,
        presence_penalty=m.presence_penalty, frequency_penalty=m.frequency_penalty,
        repetition_penalty=m.repetition_penalty or 1.0,        # unset on the wire: off
        logit_bias=tuple(sorted(m.logit_bias.items())), min_tokens=m.min_tokens,
        prompt_logprobs=m.num_top_prompt_logprobs if m.return_prompt_logprobs else None,
        grammar=grammar_from_wire(m.structured_output), min_p=m.min_p,
        grammar_after=tuple(m.structured_output.start_after), bad_words=tuple(tuple(w.ids) for w in m.bad_words),
        allowed_token_ids=tuple(m.allowed_token_ids), priority=m.priority, cache_salt=m.cache_salt)


def grammar_to_wire(grammar: tuple[str, str] | None, start_after: tuple[int, ...] = ()
                    ) -> pdserve_pb2.StructuredOutput | None:
    """``SamplingParams.grammar`` (and ``grammar_after``) as the wire's ``StructuredOutput`` (None: unset)."""
    if grammar is None:
        return None
    kind, text = grammar
    if kind == "json_object":
        out = pdserve_pb2.StructuredOutput(json_object=True)
    elif kind == "choice":
        out = pdserve_pb2.StructuredOutput(choice=pdserve_pb2.Choices(choices=json.loads(text)))
    else:
        out = pdserve_pb2.StructuredOutput(**{kind: text})
    out.start_after.extend(start_after)
    return out


def grammar_from_wire(m: pdserve_pb2.StructuredOutput) -> tuple[str, str] | None:
    """A ``StructuredOutput`` as ``SamplingParams.grammar`` (:data:`model.structured.Spec`): ``("json_object",
    "")``, ``("json_schema" | "regex" | "grammar", text)``, ``("choice", the choices as a JSON array)``, or None
    (unset, or ``json_object`` false)."""
    kind = m.WhichOneof("kind")
    if kind == "choice":
        return "choice", json.dumps(list(m.choice.choices), ensure_ascii=False)
    if kind in ("json_schema", "regex", "grammar"):
        return kind, getattr(m, kind)
    return ("json_object", "") if kind == "json_object" and m.json_object else None


def logprobs_to_wire(lp: TokenLogprobs) -> worker_pb2.TokenLogprobs:
    return worker_pb2.TokenLogprobs(logprob=lp.logprob, top_token_ids=lp.top_ids, top_logprobs=lp.top_logprobs,
                                    rank=lp.rank)
