"""Multi-step decoding: how many steps the decode engine runs in one C call, and what the call needs.

After a memory-bound decode step (at batch 1 every weight streams through the caches once) the Python
between two steps runs on cold caches: about 0.4 ms around a 5 ms bench-80m bf16 step on Zen 4, where
the same code takes 0.1 ms warm. When the next step's inputs follow from this step's logits alone, the
engine runs several steps in one call of ``decode_stack.c: pd_decode_graph_steps`` (through
:meth:`~decode_worker.graph_runner.GraphRunner.run_steps`), as vLLM's multi-step scheduling did
(``--num-scheduler-steps``). That holds for a row that is

  * greedy (temperature 0), or
  * sampled from ``softmax(logits / temperature)``, top-k cut or not, without a top-p cut: its
    exponential-race noise for the next output indexes is drawn here in advance
    (:func:`model.sampling.log_noise`, the same draws as single steps) and the C loop picks
    ``argmax(logits / temperature - log E)`` over the top-k, the float32 operations of
    :func:`model.sampling.temperature_draw`: the same tokens as single steps;

and asks for no log-probabilities. A run ends after the step where any row samples a stop token, and
after the step in progress once another thread posts work to the engine (a request arrives, KV pages
land, a client leaves), so requests still join and leave at token boundaries; tokens reach clients in
bursts of at most the window.
"""

from __future__ import annotations

import torch

from pdserve.decode_worker.config import DecodeWorkerConfig
from pdserve.decode_worker.request import DecodeRequest
from pdserve.model.sampling import log_noise, log_space

MAX_NOISE_BYTES = 8 << 20
"""Noise drawn ahead for one run at most (bytes: steps x rows x vocabulary x 4); fewer steps beyond. The
noise of steps a run does not reach (a request arrived, a row stopped) is drawn for nothing: at 2M
draws, a few milliseconds, the budget keeps that loss under a step of a model whose vocabulary is large
(8 steps of one row at a 256K vocabulary)."""


def eligible(req: DecodeRequest) -> bool:
    """Whether ``req``'s next tokens can be picked inside the C loop (greedy, or sampled without a top-p cut;
    no logprobs, no logit bias, penalties or grammar: those change each step's logits by the tokens before it)."""
    p = req.sampling
    return p.logprobs is None and not p.penalized and not p.constrained and (p.temperature == 0 or log_space(p))


def plan_steps(cfg: DecodeWorkerConfig, batch: list[DecodeRequest], last_step: tuple[int, int, float],
               vocab: int) -> int:
    """Steps to run in one call for ``batch``: ``multi_step`` at most, as many as fit in
    ``multi_step_window_s`` at the last step's time, never past a row's ``max_tokens``, with the noise of
    the sampled rows within :data:`MAX_NOISE_BYTES`; 1 unless every row is :func:`eligible`.
    ``last_step``: the engine's ``(batch, context tokens, seconds a step)`` of its last plain step; a
    batch larger than that one runs one step first (its step time is not known yet, and longer)."""
    size, _, step_s = last_step
    if cfg.multi_step < 2 or step_s <= 0 or len(batch) > size or not all(eligible(r) for r in batch):
        return 1
    k = min(cfg.multi_step, int(cfg.multi_step_window_s / step_s),
            min(r.sampling.max_tokens - len(r.output_ids) for r in batch))
    sampled = sum(r.sampling.temperature != 0 for r in batch)
    if sampled:
        k = min(k, MAX_NOISE_BYTES // (4 * vocab * len(batch)))
    return max(k, 1)


def sampling_inputs(batch: list[DecodeRequest], steps: int, vocab: int,
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(temperatures [B] float32, log_noise [steps, B, vocab] float32, top_ks [B] int32 or None)`` for a
    run of ``steps`` steps, or ``(None, None, None)`` when every row is greedy. Row ``i``'s noise at step
    ``s`` is that of its output token ``len(output_ids) + s``; greedy rows' noise is left unset (never read)."""
    if all(r.sampling.temperature == 0 for r in batch):
        return None, None, None
    temps = torch.tensor([r.sampling.temperature for r in batch], dtype=torch.float32)
    top_ks = torch.tensor([min(r.sampling.top_k, vocab) for r in batch], dtype=torch.int32) \
        if any(r.sampling.top_k for r in batch) else None
    noise = torch.empty(steps, len(batch), vocab, dtype=torch.float32)
    for i, r in enumerate(batch):
        if r.sampling.temperature != 0:
            for s in range(steps):
                noise[s, i] = log_noise(r.sampling.seed, len(r.output_ids) + s, vocab)
    return temps, noise, top_ks


def stop_union(batch: list[DecodeRequest]) -> list[int]:
    """Every token that ends some row of ``batch`` (the C loop stops after a step that samples one)."""
    return sorted(frozenset().union(*(r.stop_ids for r in batch)))
