"""The model on a CUDA GPU: greedy output against ``transformers`` through prefill and CUDA-graph
decode, and bf16 / INT4 / FP8 prefill and decode figures of a ~1.2B random Llama (part of
``bench/gpu.py``; needs a CUDA GPU, never run in CI).

Prefill runs :class:`~model.runner.ModelRunner` (a fresh prompt: SDPA); decode runs
:class:`~decode_worker.graph_runner.GraphRunner`, one CUDA graph per batch bucket, attention in the
Triton paged kernel. Times are CUDA-event medians of whole steps (host work included).
"""

from __future__ import annotations

import torch

from pdserve.decode_worker.graph_runner import GraphRunner
from pdserve.model.config import ModelConfig
from pdserve.model.kv_cache import BlockPool, KVCacheSpec
from pdserve.model.llama import LlamaForCausalLM
from pdserve.model.loader import finish_model, load_model
from pdserve.model.runner import ModelRunner, StepInput

BLOCK = 16

LLAMA_1B = ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                       num_kv_heads=8, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
                       rope_theta=500000.0, tie_word_embeddings=True)
"""Llama-3.2-1B's shape (1.24B parameters, tied head); the weights are random."""


def random_model(cfg: ModelConfig, dtype: torch.dtype, dev: torch.device, seed: int = 0) -> LlamaForCausalLM:
    """``cfg`` with N(0, 0.02) matrices and unit norms in ``dtype`` on ``dev``."""
    gen = torch.Generator(dev).manual_seed(seed)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    state = {name: (torch.randn(p.shape, generator=gen, device=dev, dtype=dtype) * 0.02 if p.dim() > 1
                    else torch.ones(p.shape, device=dev, dtype=dtype))
             for name, p in model.named_parameters()}
    return finish_model(model, cfg, state, dev)


class Session:
    """A model, its paged cache and a graph runner; :meth:`generate` prefills each prompt alone and
    decodes all of them together (padded to the graph bucket)."""

    def __init__(self, model: LlamaForCausalLM, cfg: ModelConfig, dtype: torch.dtype, dev: torch.device,
                 max_tokens: int, max_batch: int, buckets=(1, 2, 4, 8, 16, 32, 64), capture: bool = True) -> None:
        self.max_blocks = -(-max_tokens // BLOCK)
        self.pool = BlockPool(self.max_blocks * max_batch + 1)
        spec = KVCacheSpec.for_model(cfg, self.pool.num_free, BLOCK, dtype)
        self.runner = ModelRunner(model, spec, dev)
        self.graphs = GraphRunner(self.runner, self.pool, self.max_blocks, buckets, capture=capture)

    def prefill(self, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
        """Block tables and first tokens of ``prompts``, each prefilled in its own step."""
        tables, first = [], []
        for p in prompts:
            tables.append(self.pool.allocate(self.max_blocks))
            first.append(int(self.runner.run([StepInput(p, 0, tables[-1])]).argmax(-1)))
        return tables, first

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        """Greedy tokens of every prompt (``new_tokens`` each), decoded as one batch."""
        tables, first = self.prefill(prompts)
        out = [[t] for t in first]
        for _ in range(new_tokens - 1):
            batch = [StepInput([o[-1]], len(p) + len(o) - 1, t) for p, o, t in zip(prompts, out, tables)]
            for o, t in zip(out, self.graphs.run(batch).argmax(-1).tolist()):
                o.append(t)
        for t in tables:
            self.pool.free(t)
        return out


def hf_greedy(model, prompt: list[int], new_tokens: int, dev: torch.device) -> list[int]:
    """``transformers`` greedy tokens (full forward each step, no EOS stop)."""
    ids = torch.tensor([prompt], device=dev)
    with torch.inference_mode():
        for _ in range(new_tokens):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


def exactness(model_dir: str, dev: torch.device, new_tokens: int = 48) -> list[dict]:
    """Per dtype: how many of each prompt's greedy tokens match ``transformers`` on the same GPU
    (prompts decoded together through the CUDA graphs), and whether graph replay gives the eager
    step's logits."""
    from transformers import AutoModelForCausalLM
    gen = torch.Generator().manual_seed(1)
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        ours, cfg = load_model(model_dir, dtype, dev)
        prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist() for n in (5, 23, 61)]
        got = Session(ours, cfg, dtype, dev, 128, 4, buckets=(1, 2, 4)).generate(prompts, new_tokens)
        eager = Session(ours, cfg, dtype, dev, 128, 4, buckets=(1, 2, 4), capture=False).generate(prompts, new_tokens)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(dev).eval()
        want = [hf_greedy(hf, p, new_tokens, dev) for p in prompts]
        match = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w)) for g, w in zip(got, want)]
        margins = []        # at a divergence: transformers' logit of its token minus its logit of ours
        for p, g, w, i in zip(prompts, got, want, match):
            if i < len(w):
                with torch.inference_mode():
                    row = hf(torch.tensor([p + w[:i]], device=dev)).logits[0, -1].float()
                margins.append({"position": i, "margin": float(row[w[i]] - row[g[i]]),
                                "logit_scale": float(row.abs().max())})
        results.append({"dtype": str(dtype).removeprefix("torch."), "tokens": new_tokens,
                        "matching_prefix": match, "divergences": margins, "graph_equals_eager": got == eager})
        del ours, hf
    return results


def _event_ms(fn, reps: int) -> float:
    """Median milliseconds of ``fn`` over ``reps`` CUDA-event-timed calls (after one warm-up)."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes of the weights a decode step reads (the tied head counted once; of an INT4 projection
    only its kernel layout, not the checkpoint-format copy it keeps beside it)."""
    from pdserve.model.quant.int4 import _LAYOUT_BUFFERS, TINYGEMM, Int4Linear
    seen, total = set(), 0
    for mod in model.modules():
        tensors = list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False))
        if isinstance(mod, Int4Linear):  # the buffers its decode rows read
            names = _LAYOUT_BUFFERS[mod._layout]
            tensors = [getattr(mod, name) for name in (names[2:] if mod._layout == TINYGEMM else names)]
        for t in tensors:
            if t is not None and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


def speed(model: LlamaForCausalLM, cfg: ModelConfig, dtype: torch.dtype, dev: torch.device, label: str,
          prompt_lens=(512, 2048), batches=(1, 32, 64), ctx: int = 512, eager: bool = False) -> dict:
    """Prefill milliseconds per prompt length and decode step milliseconds per batch size at
    ``ctx`` tokens of context, with the bytes a batch-1 step must read."""
    res = {"label": label, "weight_bytes": weight_bytes(model), "prefill_ms": {}, "decode_ms": {}}
    s = Session(model, cfg, dtype, dev, max(max(prompt_lens, default=0), ctx + 64), max(batches), buckets=batches,
                capture=not eager)
    table = s.pool.allocate(s.max_blocks)
    for n in prompt_lens:
        prompt = torch.randint(3, cfg.vocab_size, (n,)).tolist()
        res["prefill_ms"][n] = _event_ms(lambda: s.runner.run([StepInput(prompt, 0, table)]), 5)
    s.pool.free(table)
    for b in batches:
        tables = [s.pool.allocate(s.max_blocks) for _ in range(b)]
        batch = [StepInput([7], ctx, t) for t in tables]
        res["decode_ms"][b] = _event_ms(lambda: s.graphs.run(batch), 30)
        for t in tables:
            s.pool.free(t)
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * s.runner.kv_cache.element_size()
    res["kv_bytes_b1"] = (ctx + 1) * per_token
    return res


def model_flops(cfg: ModelConfig, tokens: int) -> float:
    """FLOPs of a fresh prefill of ``tokens`` (projections, LM head of the last token, causal attention)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_token = 2 * cfg.num_layers * (cfg.hidden_size * (2 * q + 2 * kv) + 3 * cfg.hidden_size * cfg.intermediate_size)
    attention = 2 * cfg.num_layers * 2 * q * tokens * (tokens + 1) / 2
    return per_token * tokens + attention + 2 * cfg.hidden_size * cfg.vocab_size


def profile_steps(dev: torch.device, prompt_len: int = 512) -> dict:
    """``torch.profiler`` tables (top operators by host and by device time) of one bf16 1B prefill of
    ``prompt_len`` tokens and one batch-1 graph decode step."""
    from torch.profiler import ProfilerActivity, profile
    cfg = LLAMA_1B
    s = Session(random_model(cfg, torch.bfloat16, dev), cfg, torch.bfloat16, dev, prompt_len + 64, 1, buckets=(1,))
    table = s.pool.allocate(s.max_blocks)
    prompt = torch.randint(3, cfg.vocab_size, (prompt_len,)).tolist()
    steps = {"prefill": lambda: s.runner.run([StepInput(prompt, 0, table)]),
             "decode": lambda: s.graphs.run([StepInput([7], prompt_len, table)])}
    out = {}
    for name, fn in steps.items():
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        avg = prof.key_averages()
        out[name] = {"by_host": avg.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60),
                     "by_device": avg.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60)}
    return out


def run_model(dev: torch.device, model_dir: str) -> dict:
    """Exactness on ``model_dir``, then the 1B figures: bf16 (graphs, and eager for comparison), INT4
    (RTN, group 128, Triton W4A16), FP8 (per-channel activations through ``_scaled_mm``)."""
    from pdserve.model.quant import fp8, int4
    out = {"exact": exactness(model_dir, dev), "speed": []}
    cfg = LLAMA_1B
    model = random_model(cfg, torch.bfloat16, dev)
    out["speed"].append(speed(model, cfg, torch.bfloat16, dev, "bf16"))
    out["speed"].append(speed(model, cfg, torch.bfloat16, dev, "bf16 eager (no graphs)", prompt_lens=(),
                              batches=(1, 32), eager=True))
    fp8.convert_for_runtime(model)
    out["speed"].append(speed(model, cfg, torch.bfloat16, dev, "fp8 per-channel", batches=(1, 32)))
    del model
    model = random_model(cfg, torch.bfloat16, dev)
    int4.convert_for_runtime(model, group_size=128, method="rtn")
    out["int4_kernel_b1"] = next(m for m in model.modules() if isinstance(m, int4.Int4Linear)).kernel_for(1)
    out["speed"].append(speed(model, cfg, torch.bfloat16, dev, f"int4 rtn g128 ({out['int4_kernel_b1']})"))
    if out["int4_kernel_b1"] == int4.TINYGEMM:  # the same weights on the Triton kernel at every row
        int4.Int4Linear.cuda_tinygemm = False
        try:
            out["speed"].append(speed(model, cfg, torch.bfloat16, dev, "int4 rtn g128 (int4-triton)"))
        finally:
            int4.Int4Linear.cuda_tinygemm = True
    return out
