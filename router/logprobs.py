"""The client's log-probabilities from a worker's: prompt and sampled tokens' ``TokenLogprob`` messages built
from the workers' wire entries, and their token texts filled in (each token decoded alone, cached per tokenizer).
"""

from __future__ import annotations

from pdserve.model.tokenizer import Tokenizer
from pdserve.proto import pdserve_pb2, worker_pb2
from pdserve.router.recovery import Progress, WorkerFailure
from pdserve.router.validation import ValidRequest

__all__ = ["logprobs_of", "name_tokens", "prompt_logprobs_of"]


def name_tokens(logprobs, tokenizer: Tokenizer) -> None:
    """Fill in the text of every token of ``logprobs`` (``TokenLogprob`` messages, in place)."""
    for lp in logprobs:
        lp.token = _token_text(tokenizer, lp.token_id)
        for alt in lp.top:
            alt.token = _token_text(tokenizer, alt.token_id)


def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    cache = _TOKEN_TEXTS.setdefault(id(tokenizer), {})
    text = cache.get(token_id)
    if text is None:
        text = cache[token_id] = tokenizer.decode([token_id])
    return text


_TOKEN_TEXTS: dict[int, dict[int, str]] = {}  # id(tokenizer) -> token id -> its text alone (bounded by the vocab)


def prompt_logprobs_of(req: ValidRequest, progress: Progress, wire, worker_id: str) -> list[pdserve_pb2.TokenLogprob]:
    """The client's prompt log-probabilities for the request's first message (``progress`` has streamed no token
    yet, and the request asks): one per prompt token, the first's logprob 0 with no alternatives, the rest from
    the worker's ``wire`` entries; none for any later message.

    Raises:
        WorkerFailure: the worker sent another number of entries than the prompt's tokens after the first.
    """
    if req.sampling.prompt_logprobs is None or progress.generated:
        return []
    if len(wire) != len(req.prompt_ids) - 1:
        raise WorkerFailure({worker_id}, f"worker {worker_id} sent {len(wire)} prompt log-probabilities for a "
                                         f"{len(req.prompt_ids)}-token prompt")
    return [pdserve_pb2.TokenLogprob(token_id=req.prompt_ids[0])] + logprobs_of(req.prompt_ids[1:], list(wire))


def logprobs_of(ids: list[int], wire: list[worker_pb2.TokenLogprobs]) -> list[pdserve_pb2.TokenLogprob]:
    """The client's ``TokenLogprob`` messages for ``ids`` from a worker's (texts filled in later)."""
    return [pdserve_pb2.TokenLogprob(
        token_id=t, logprob=w.logprob, rank=w.rank,
        top=[pdserve_pb2.TopLogprob(token_id=i, logprob=v) for i, v in zip(w.top_token_ids, w.top_logprobs)])
        for t, w in zip(ids, wire)]
