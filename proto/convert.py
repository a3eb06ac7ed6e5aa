"""Conversions between wire messages and in-process types."""

from __future__ import annotations

from pdserve.model.sampling import SamplingParams
from pdserve.proto import pdserve_pb2, worker_pb2

FINISH_REASONS = {
    "stop": pdserve_pb2.FINISH_REASON_STOP,
    "length": pdserve_pb2.FINISH_REASON_LENGTH,
}


def sampling_to_wire(p: SamplingParams) -> worker_pb2.ResolvedSampling:
    return worker_pb2.ResolvedSampling(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed, max_tokens=p.max_tokens,
        stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos)


def sampling_from_wire(m: worker_pb2.ResolvedSampling) -> SamplingParams:
    return SamplingParams(
        temperature=m.temperature, top_p=m.top_p, top_k=m.top_k, seed=m.seed, max_tokens=m.max_tokens,
        stop_token_ids=tuple(m.stop_token_ids), ignore_eos=m.ignore_eos)
