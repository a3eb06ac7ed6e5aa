"""Configuration of a decode worker process."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.cluster.args import check_port, check_seconds
from pdserve.cluster.worker_config import WorkerConfig


@dataclass(frozen=True)
class DecodeWorkerConfig(WorkerConfig):
    """A decode worker: :class:`WorkerConfig` plus its batching and KV receiver settings.

    Attributes:
        kv_port: TCP port of the KV receiver (0 = pick a free one).
        max_batch_size: requests decoded together in one step at most.
        kv_io_timeout_s: a KV connection idle this long (seconds) is dropped.
        speculative: ``off``, ``ngram`` (prompt lookup), ``self`` (the first ``spec_draft_layers``
            layers draft) or ``draft`` (the checkpoint ``spec_draft_model`` drafts).
        spec_k: proposal length k.
        spec_max_batch_size: speculation runs only while the batch is at most this large
            (beyond it verification costs more than it saves; measured by ``bench/decode.py``).
        spec_adaptive: decide per request whether it drafts (:class:`~decode_worker.speculative.AdaptiveSpeculation`):
            it stops while its acceptance is below ``spec_min_acceptance`` and probes to resume.
            False: every request below the batch threshold drafts every step.
        spec_min_acceptance: break-even acceptance (accepted / drafted): a verify step of ``d`` drafts costs
            about ``1 + spec_min_acceptance * d`` plain steps.
        spec_ewma_weight: weight of the newest verify step in a request's acceptance estimate.
        spec_probe_interval / spec_max_probe_interval: steps between probes of a request that does not
            draft; doubled after each failed probe, up to the maximum.
        colocated: also prefill prompts here (role ``both``): requests never leave the worker;
            prompt chunks of at most ``max_num_batched_tokens`` minus the decode batch share
            each step with the decodes.
        max_num_batched_tokens: token budget of a step that prefills (colocated mode; in any mode, a preempted
            request prefilled again).
        weights: ``native`` (the checkpoint's dtype cast to ``dtype``) or ``int4`` (group-wise
            asymmetric 4-bit, quantized at load unless the checkpoint is pre-quantized).
        int4_group_size: input columns per INT4 scale group.
        int4_method: how load-time INT4 quantization rounds: ``mse`` (clip search, data-free),
            ``rtn`` or ``gptq`` (calibrated on text the model samples itself; slower to load).
        multi_step: decode steps run in one C call at most (multi-step decoding, for batches of greedy
            requests and requests sampled without a top-p cut,
            :mod:`decode_worker.multi_step`); 1 turns it off.
        multi_step_window_s: a multi-step run lasts about this long at most (seconds, at the last
            step's time): tokens reach clients in bursts no longer than this.
        graph: run plain decode steps through the :class:`~decode_worker.graph_runner.GraphRunner`
            (padded buckets and static buffers; CUDA graphs on GPUs).
    """

    kv_port: int = 0
    max_batch_size: int = 64
    kv_io_timeout_s: float = 10.0
    speculative: str = "off"
    spec_k: int = 4
    spec_draft_layers: int = 1
    spec_draft_model: str = ""
    spec_max_batch_size: int = 1  # bench/decode.py: n-gram speculation paid only at batch 1 on this machine
    spec_adaptive: bool = True
    spec_min_acceptance: float = 0.3
    spec_ewma_weight: float = 0.3
    spec_probe_interval: int = 4
    spec_max_probe_interval: int = 32
    graph: bool = True
    multi_step: int = 8
    multi_step_window_s: float = 0.025
    colocated: bool = False
    max_num_batched_tokens: int = 512
    weights: str = "native"
    int4_group_size: int = 128
    int4_method: str = "mse"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.weights not in ("native", "int4"):
            raise ValueError(f"weights must be native or int4, got {self.weights!r}")
        if self.int4_method not in ("mse", "rtn", "gptq"):
            raise ValueError(f"int4_method must be mse, rtn or gptq, got {self.int4_method!r}")
        if self.speculative not in ("off", "ngram", "self", "draft"):
            raise ValueError(f"speculative must be off, ngram, self or draft, got {self.speculative!r}")
        if self.speculative == "draft" and not self.spec_draft_model:
            raise ValueError("speculative=draft needs spec_draft_model (a checkpoint directory)")
        if self.spec_k < 1 or self.spec_draft_layers < 1 or self.spec_max_batch_size < 0:
            raise ValueError("spec_k and spec_draft_layers must be >= 1, spec_max_batch_size >= 0")
        if not (0 <= self.spec_min_acceptance <= 1 and 0 < self.spec_ewma_weight <= 1
                and 1 <= self.spec_probe_interval <= self.spec_max_probe_interval):
            raise ValueError("need 0 <= spec_min_acceptance <= 1, 0 < spec_ewma_weight <= 1 and "
                             "1 <= spec_probe_interval <= spec_max_probe_interval")
        if self.multi_step < 1 or not 0 <= self.multi_step_window_s <= 1:
            raise ValueError(f"multi_step must be >= 1 and multi_step_window_s in [0, 1] seconds, got "
                             f"{self.multi_step} and {self.multi_step_window_s}")
        if self.max_batch_size <= 0:
            raise ValueError(f"max_batch_size must be positive, got {self.max_batch_size}")
        check_seconds("kv_io_timeout_s", self.kv_io_timeout_s)
        check_port("kv_port", self.kv_port)
        if self.max_num_batched_tokens <= 0:   # colocated: 0 prefilled one token a step
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
