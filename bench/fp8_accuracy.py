"""First-token agreement of the FP8 (e4m3 W8A8) model with the fp32 model on a real checkpoint.

Loads the checkpoint twice (fp32, and fp32 with :func:`model.quant.fp8.convert_for_runtime`
applied), prefills a fixed, deterministic prompt set through
:class:`model.runner.ModelRunner` on a paged KV cache, and compares the next-token
distributions at the last prompt position:

* top-1 agreement: fraction of prompts whose argmax token is the same;
* KL(p_fp32 || p_fp8) in nats, ``sum_v p32[v] * (log p32[v] - log p8[v])``, from
  ``log_softmax`` of the fp32 logits, computed in float64.

The issue's target is top-1 agreement >= 97%. On CPU the FP8 path runs the FP8
numerics through an ordinary matmul, so this measures accuracy, not speed. Two yardsticks
are measured alongside: the whole model in bf16 (weights, activations, KV cache, head), and
only the same four projections in bf16 (weights and inputs rounded, fp32 accumulation) --
the 16-bit counterpart of exactly what FP8 changes.

    python bench/fp8_accuracy.py [--model DIR] [--out bench/out/fp8_accuracy.json] [--cpu-matmul-dtype float32]
                                 [--group-size none|G] [--keep-high-precision NAME[,NAME...]]

``--group-size G`` uses DeepSeek-V3 fine-grained scales (per-token 1xG activation tiles, GxG
weight blocks); ``--keep-high-precision`` leaves projections in fp32, e.g.
``0.self_attn.qkv_proj`` (layer 0 only) or ``mlp.down_proj`` (all layers); see
:func:`model.quant.fp8.convert_for_runtime`.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from pdserve.model.config import ModelConfig
from pdserve.model.kv_cache import KVCacheSpec
from pdserve.model.loader import load_model
from pdserve.model.quant.fp8 import _PROJECTIONS, convert_for_runtime
from pdserve.model.runner import ModelRunner, StepInput
from pdserve.model.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent

DEFAULT_MODEL = ROOT / "assets" / "models" / "tinystories-656k"
DEFAULT_OUT = ROOT / "bench" / "out" / "fp8_accuracy.json"

# Hand-written prompts: whole sentences and open-ended prefixes in the TinyStories register.
_SENTENCES = [
    "Once upon a time, there was a little dog",
    "Once upon a time, there was a little girl named Lily.",
    "One day, a boy named Tim went to the park",
    "The sun was shining and the birds were singing.",
    "Mom said, \"Be careful with the cup!\"",
    "The cat jumped on the bed and",
    "Sara had a red ball. She liked to",
    "There was a big tree in the garden. Under the tree,",
    "Ben was sad because his toy was broken.",
    "The little bird could not fly, so",
    "Anna and her brother went to the beach to",
    "It was a cold winter day. The snow",
    "Tom saw a shiny rock on the ground.",
    "The frog said, \"Hello! Do you want to play?\"",
    "Lucy wanted to bake a cake for her mom.",
    "The old man had a boat. Every morning he",
    "Max the puppy was very hungry. He",
    "The princess lived in a tall castle",
    "Once upon a time, in a small village, there lived",
    "Sue looked out of the window and saw",
    "The teddy bear was soft and",
    "Jack and Jill climbed the hill to",
    "The car went fast down the road.",
    "A little mouse lived in a hole in the wall.",
    "The kids played with the blocks. They built",
    "Dad gave Lily a big hug and said,",
    "The duck swam in the pond with her",
    "One night, the moon was very bright.",
    "Mia found a box under her bed. Inside the box",
    "The elephant was big and gray. He liked to",
    "Tim was scared of the dark, but",
    "They all went home and had a nice",
    "The flower was pretty and yellow.",
    "Sam wanted to help his friend, so he",
    "The rain stopped and a rainbow",
    "Grandma made soup. It was hot and",
    "The bunny hopped into the forest and",
    "Lily said sorry and they were friends again.",
    "The truck was stuck in the mud.",
    "At the end of the day, everyone was happy",
]

# Original TinyStories-style paragraphs; prompts are word-boundary prefixes cut from them.
_STORIES = [
    "Once upon a time, there was a little boy named Leo. Leo loved to play with his red ball in the "
    "yard. One day, the ball rolled into the street. Leo wanted to get it, but his mom said no. "
    "She held his hand and they got the ball together. Leo smiled and said thank you.",
    "Amy had a pet fish named Blue. Blue lived in a small bowl on the table. Every morning, Amy gave "
    "Blue some food. One day, Blue did not want to eat. Amy was worried. Her dad helped her clean "
    "the bowl, and soon Blue was swimming happily again.",
    "In a big green forest, there lived a kind bear. The bear liked to share his honey with his "
    "friends. One day, a small rabbit was lost and crying. The bear gave the rabbit some honey and "
    "helped him find his way home. The rabbit was very happy.",
    "It was a sunny day at the park. Kim and Joe wanted to go on the swing, but there was only one. "
    "They started to fight. Then Kim had an idea. They could take turns! Joe went first, and then "
    "Kim. They laughed and played all day long.",
]


def build_prompts(cut_every: int = 4) -> list[str]:
    """The fixed prompt set: the hand-written prompts, then every ``cut_every``-word prefix of
    each story (at least 3 words, whole story excluded); deterministic, duplicates dropped."""
    prompts = list(_SENTENCES)
    for story in _STORIES:
        words = story.split()
        prompts += [" ".join(words[:n]) for n in range(3, len(words), cut_every)]
    return list(dict.fromkeys(prompts))


def _first_token_logits(runner: ModelRunner, prompts_ids: list[list[int]], max_batch: int) -> torch.Tensor:
    """Prefill each prompt (``max_batch`` per step, fresh blocks) -> ``[P, vocab]`` fp32 logits."""
    out, bs = [], runner.spec.block_size
    for i in range(0, len(prompts_ids), max_batch):
        batch, next_block = [], 0
        for ids in prompts_ids[i:i + max_batch]:
            nb = -(-len(ids) // bs)
            batch.append(StepInput(ids, 0, list(range(next_block, next_block + nb))))
            next_block += nb
        out.append(runner.run(batch))
    return torch.cat(out)


class _Bf16Linear(torch.nn.Module):
    """Yardstick: ``nn.Linear`` with weight and input rounded to bf16, fp32 matmul and output."""

    def __init__(self, lin: torch.nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = lin.weight.detach().bfloat16().float(), lin.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.bfloat16().float(), self.weight, self.bias)


def _projections_to_bf16(model: torch.nn.Module) -> None:
    for layer in model.layers:
        for path in _PROJECTIONS:
            parent, attr = path.split(".")
            setattr(getattr(layer, parent), attr, _Bf16Linear(getattr(getattr(layer, parent), attr)))


def measure_first_token_agreement(model_dir: str | Path, prompts: list[str] | list[list[int]], *,
                                  cpu_matmul_dtype: torch.dtype = torch.float32, block_size: int = 16,
                                  max_batch: int = 32, baseline_dtype: torch.dtype | None = None,
                                  group_size: int | None = None, keep_high_precision: tuple[str, ...] = (),
                                  projection_baseline: bool = False) -> dict:
    """Compare next-token distributions after prefill: fp32 model vs the FP8-converted copy.

    Args:
        model_dir: a Llama checkpoint directory.
        prompts: texts (tokenized with the checkpoint's tokenizer, BOS added as it asks)
            or token-id lists.
        cpu_matmul_dtype, group_size, keep_high_precision: passed to :func:`convert_for_runtime`
            (``group_size`` None: per-token / per-channel scales; G: 1xG / GxG scales).
        block_size, max_batch: KV cache block size and prompts per prefill step.
        baseline_dtype: when given (e.g. ``torch.bfloat16``), also run the *whole* model in that
            dtype (weights, activations, KV cache) as a yardstick for how tight the target is.
        projection_baseline: also run fp32 with only the four projections in bf16 (weights and
            inputs rounded to bf16, fp32 matmul): the 16-bit version of what FP8 changes.
    Returns:
        ``{"num_prompts", "top1_agreement" (fraction), "mean_kl", "median_kl", "max_kl"
        (nats), "per_prompt": [{"prompt", "num_tokens", "top1_fp32", "top1_fp8", "kl",
        "margin_fp32"}], ...}``; ``margin_fp32`` is the fp32 logit gap between its top two tokens.
        With ``baseline_dtype``, also ``"baseline": {"dtype", "top1_agreement", "mean_kl"}``; with
        ``projection_baseline``, ``"baseline_projections_bf16"`` of the same form.
    """
    model_dir = Path(model_dir)
    ref, cfg = load_model(model_dir, torch.float32)
    fp8, _ = load_model(model_dir, torch.float32)
    convert_for_runtime(fp8, cpu_matmul_dtype=cpu_matmul_dtype, group_size=group_size,
                        keep_high_precision=keep_high_precision)
    if prompts and isinstance(prompts[0], str):
        tok = Tokenizer(model_dir, cfg.bos_token_id)
        ids = [tok.encode(p) for p in prompts]
    else:
        ids = [list(p) for p in prompts]
    if not ids or any(not p for p in ids):
        raise ValueError("need at least one prompt, none empty")
    max_len = max(len(p) for p in ids)
    num_blocks = max_batch * -(-max_len // block_size)
    models = [("fp32", ref, torch.float32), ("fp8", fp8, torch.float32)]
    if baseline_dtype is not None:
        models.append(("baseline", load_model(model_dir, baseline_dtype)[0], baseline_dtype))
    if projection_baseline:
        proj_bf16 = load_model(model_dir, torch.float32)[0]
        _projections_to_bf16(proj_bf16)
        models.append(("baseline_projections_bf16", proj_bf16, torch.float32))
    logits = {}
    for name, model, dtype in models:
        spec = KVCacheSpec.for_model(cfg, num_blocks, block_size, dtype)
        logits[name] = _first_token_logits(ModelRunner(model, spec), ids, max_batch).double()
    lp = {k: torch.log_softmax(v, -1) for k, v in logits.items()}
    lp32, lp8 = lp["fp32"], lp["fp8"]
    kl = (lp32.exp() * (lp32 - lp8)).sum(-1)
    top32, top8 = lp32.argmax(-1), lp8.argmax(-1)
    top2 = logits["fp32"].topk(2, dim=-1).values
    per = [{"prompt": p if isinstance(p, str) else None, "num_tokens": len(t), "top1_fp32": int(a),
            "top1_fp8": int(b), "kl": float(k), "margin_fp32": float(m[0] - m[1])}
           for p, t, a, b, k, m in zip(prompts, ids, top32, top8, kl, top2)]
    result = {"model_dir": str(model_dir), "num_prompts": len(ids),
              "cpu_matmul_dtype": str(cpu_matmul_dtype).removeprefix("torch."),
              "group_size": group_size, "keep_high_precision": list(keep_high_precision),
              "top1_agreement": float((top32 == top8).double().mean()),
              "mean_kl": float(kl.mean()), "median_kl": float(kl.median()), "max_kl": float(kl.max()),
              "per_prompt": per}
    for name, dtype in (("baseline", baseline_dtype), ("baseline_projections_bf16", torch.bfloat16)):
        if name in lp:
            lpb = lp[name]
            result[name] = {"dtype": str(dtype).removeprefix("torch."),
                            "top1_agreement": float((lpb.argmax(-1) == top32).double().mean()),
                            "mean_kl": float((lp32.exp() * (lp32 - lpb)).sum(-1).mean())}
    return result


def _table(result: dict) -> str:
    """Rows by prompt length bucket, then the total."""
    per = result["per_prompt"]
    buckets = [(1, 8), (9, 16), (17, 32), (33, 10**9)]
    lines = [f"{'prompt tokens':>14} {'n':>4} {'top-1 agree':>12} {'mean KL':>10} {'max KL':>10}"]

    def row(label, items):
        agree = sum(p["top1_fp32"] == p["top1_fp8"] for p in items) / len(items)
        kls = [p["kl"] for p in items]
        lines.append(f"{label:>14} {len(items):>4} {agree:>11.1%} {sum(kls) / len(kls):>10.2e} {max(kls):>10.2e}")

    for lo, hi in buckets:
        items = [p for p in per if lo <= p["num_tokens"] <= hi]
        if items:
            row(f"{lo}-{hi}" if hi < 10**9 else f">={lo}", items)
    row("all", per)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--cpu-matmul-dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--group-size", default="none", type=lambda v: None if v.lower() == "none" else int(v),
                    help="none (per-token act / per-channel weight scales) or G (1xG act tiles, GxG weight blocks)")
    ap.add_argument("--keep-high-precision", default="", help="comma-separated [<layer>.]<projection> left in fp32")
    args = ap.parse_args()
    torch.set_num_threads(1)
    prompts = build_prompts()
    keep = tuple(k for k in args.keep_high_precision.split(",") if k)
    result = measure_first_token_agreement(args.model, prompts,
                                           cpu_matmul_dtype=getattr(torch, args.cpu_matmul_dtype),
                                           baseline_dtype=torch.bfloat16, group_size=args.group_size,
                                           keep_high_precision=keep, projection_baseline=True)
    result.update(torch=torch.__version__, platform=platform.platform(), device="cpu", target_top1=0.97)
    g = args.group_size
    gran = "per-token act, per-channel weight" if g is None else f"per-token 1x{g} act tiles, {g}x{g} weight blocks"
    print(f"FP8 e4m3 W8A8 ({gran}{'; fp32: ' + ','.join(keep) if keep else ''}) vs fp32: {result['model_dir']}, "
          f"CPU matmul {result['cpu_matmul_dtype']}")
    print(_table(result))
    tok_names = None
    for p in result["per_prompt"]:
        if p["top1_fp32"] != p["top1_fp8"]:
            if tok_names is None:
                tok_names = Tokenizer(args.model, ModelConfig.from_hf_dir(args.model).bos_token_id)
            print(f"  disagree: {p['prompt']!r}: fp32 {tok_names.decode([p['top1_fp32']])!r} vs "
                  f"fp8 {tok_names.decode([p['top1_fp8']])!r} (fp32 margin {p['margin_fp32']:.3f}, KL {p['kl']:.2e})")
    b, bp = result["baseline"], result["baseline_projections_bf16"]
    print(f"yardsticks: the whole model in {b['dtype']} agrees {b['top1_agreement']:.1%} "
          f"(mean KL {b['mean_kl']:.2e} nats); only the four projections in bf16: "
          f"{bp['top1_agreement']:.1%} (mean KL {bp['mean_kl']:.2e} nats)")
    verdict = "meets" if result["top1_agreement"] >= 0.97 else "MISSES"
    print(f"top-1 agreement {result['top1_agreement']:.1%} {verdict} the 97% target; "
          f"mean KL {result['mean_kl']:.2e} nats")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
