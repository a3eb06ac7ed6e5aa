"""Perplexity of the embedded TinyStories model: pdserve (fp32, bf16, INT4) against llama.cpp (f32, bf16, Q4_0).

pdserve's number follows ``llama-perplexity``'s protocol exactly (``tools/perplexity/perplexity.cpp``,
``perplexity()``, the default path without ``--ppl-stride``):

  * the whole text is tokenized once, with BOS in front where the vocabulary adds one;
  * it is cut into ``len(tokens) // n_ctx`` chunks of ``n_ctx`` tokens (the tail is dropped);
  * each chunk runs from an empty cache with its first token replaced by BOS (if BOS is added);
  * only the second half is scored: the logits at positions ``n_ctx/2 .. n_ctx-2`` predict tokens
    ``n_ctx/2+1 .. n_ctx-1`` (``n_ctx - n_ctx/2 - 1`` tokens per chunk);
  * perplexity = exp(mean negative log-likelihood over all scored tokens).

llama.cpp's own tokens come back through ``--kl-divergence-base FILE`` (that file starts with
``"_logits_"``, ``n_ctx``, ``n_vocab``, ``n_chunk`` (int32) and the ``n_chunk * n_ctx`` int32 tokens), so the
two sides are checked to see the same token ids, and pdserve is scored on exactly those ids.

    .venv/bin/python bench/perplexity.py --out docs/results/peers/perplexity [--ctx 256] [--core 1]
"""

from __future__ import annotations

import argparse
import json
import re
import struct
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from pdserve.bench.common import ROOT
from pdserve.bench.peers_llamacpp import build, convert, quantize

TINY = ROOT / "assets" / "models" / "tinystories-656k"
TEXT = ROOT / "docs" / "results" / "peers" / "tinystories_valid_first10.txt"
GGUF_DIR = Path.home() / ".cache" / "pdserve" / "peers" / "gguf"
PDSERVE_VARIANTS = (("fp32", "float32", "native"), ("bf16", "bfloat16", "native"), ("int4", "bfloat16", "int4"),
                    ("int4_fp32", "float32", "int4"))


def chunked_perplexity(logits_fn: Callable[[list[int]], torch.Tensor], tokens: list[int], n_ctx: int,
                       bos_id: int | None) -> dict:
    """Perplexity with ``llama-perplexity``'s protocol (see the module docstring).

    Args:
        logits_fn: ``chunk`` (``n_ctx`` token ids, a fresh sequence from position 0) -> logits
            ``[n_ctx, vocab]`` (any float dtype; scored in float64).
        tokens: the tokenized text, BOS in front where the vocabulary adds one.
        n_ctx: chunk length in tokens (even, >= 4).
        bos_id: the BOS id each chunk's first token is replaced by, or None (vocabulary adds no BOS).

    Returns:
        ``{"ppl", "nll", "num_scored", "num_chunks", "n_ctx"}``; ``nll`` is the mean in nats.

    Raises:
        ValueError: fewer than ``2 * n_ctx`` tokens (llama-perplexity refuses those too).
    """
    if len(tokens) < 2 * n_ctx:
        raise ValueError(f"{len(tokens)} tokens; perplexity with n_ctx={n_ctx} needs at least {2 * n_ctx}")
    first = n_ctx // 2
    nll, count = 0.0, 0
    num_chunks = len(tokens) // n_ctx
    for i in range(num_chunks):
        chunk = list(tokens[i * n_ctx:(i + 1) * n_ctx])
        if bos_id is not None:
            chunk[0] = bos_id
        logits = logits_fn(chunk)[first:n_ctx - 1].double()
        targets = torch.tensor(tokens[i * n_ctx + first + 1:(i + 1) * n_ctx])
        logp = torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0]
        nll -= float(logp.sum())
        count += len(targets)
    mean = nll / count
    return {"ppl": float(torch.tensor(mean, dtype=torch.float64).exp()), "nll": mean, "num_scored": count,
            "num_chunks": num_chunks, "n_ctx": n_ctx}


def pdserve_logits_fn(model_dir: str | Path, dtype: str, weights: str, n_ctx: int):
    """A ``logits_fn`` for :func:`chunked_perplexity`: the model loaded as the decode worker loads it
    (``decode_worker.server.load_decode_model``), each chunk one prefill step on a fresh paged cache.

    ``dtype`` is ``"float32"`` or ``"bfloat16"``, ``weights`` ``"native"`` or ``"int4"``.
    """
    from pdserve.decode_worker.config import DecodeWorkerConfig
    from pdserve.decode_worker.server import load_decode_model
    from pdserve.model.kv_cache import KVCacheSpec
    from pdserve.model.runner import ModelRunner, StepInput

    block = 16
    blocks = n_ctx // block + 2
    wcfg = DecodeWorkerConfig(model_dir=str(model_dir), worker_id="ppl", dtype=dtype, num_blocks=blocks,
                              block_size=block, max_batch_size=1, graph=False, weights=weights)
    model, cfg = load_decode_model(wcfg)
    runner = ModelRunner(model, KVCacheSpec.for_model(cfg, blocks, block, wcfg.torch_dtype))
    table = list(range(blocks))

    def logits_fn(chunk: list[int]) -> torch.Tensor:
        return runner.run([StepInput(chunk, 0, table)], all_logits=True)

    return logits_fn


def read_llamacpp_tokens(path: Path) -> tuple[int, list[int]]:
    """``(n_ctx, tokens)`` from a ``llama-perplexity --kl-divergence-base`` file (``n_chunk * n_ctx`` ids).

    Raises:
        ValueError: not such a file.
    """
    with open(path, "rb") as f:
        if f.read(8) != b"_logits_":
            raise ValueError(f"{path} is not a llama-perplexity logits file")
        n_ctx, _n_vocab, n_chunk = struct.unpack("<iii", f.read(12))
        ids = struct.unpack(f"<{n_ctx * n_chunk}i", f.read(4 * n_ctx * n_chunk))
    return n_ctx, list(ids)


def llama_perplexity(info: dict, gguf: Path, text: Path, n_ctx: int, core: int | None,
                     base_file: Path | None = None) -> dict:
    """Run ``llama-perplexity -t 1 -c n_ctx -f text`` (pinned with ``taskset`` to ``core``): ``{"ppl", "err"}``.

    Raises:
        RuntimeError: no "Final estimate" line in its output (the tail of the output is in the message).
    """
    cmd = [str(Path(info["bin"]) / "llama-perplexity"), "-m", str(gguf), "-f", str(text), "-c", str(n_ctx),
           "-t", "1", "-b", str(n_ctx)]
    if base_file is not None:
        cmd += ["--kl-divergence-base", str(base_file)]
    if core is not None:
        cmd = ["taskset", "-c", str(core), *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True)
    m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", out.stdout + out.stderr)
    if m is None:
        raise RuntimeError(f"llama-perplexity failed ({out.returncode}): {(out.stdout + out.stderr)[-2000:]}")
    return {"ppl": float(m.group(1)), "err": float(m.group(2)), "command": " ".join(cmd)}


def compare(n_ctx: int, core: int | None, text: Path = TEXT, model_dir: Path = TINY, log=print) -> dict:
    """Both sides on ``text``: llama.cpp f32 / bf16 / Q4_0 GGUFs and pdserve fp32 / bf16 / INT4, same token ids."""
    from pdserve.model.tokenizer import Tokenizer

    info = build(log=log)
    f32 = convert(info, model_dir, GGUF_DIR / "tinystories-656k-f32.gguf", "f32")
    bf16 = convert(info, model_dir, GGUF_DIR / "tinystories-656k-bf16.gguf", "bf16")
    q4_0 = quantize(info, f32, GGUF_DIR / "tinystories-656k-q4_0.gguf", "Q4_0")
    result: dict = {"text": str(text.relative_to(ROOT)) if text.is_relative_to(ROOT) else str(text),
                    "model": str(model_dir.relative_to(ROOT)), "n_ctx": n_ctx, "llama_cpp": {}, "pdserve": {}}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "f32.logits"
        result["llama_cpp"]["f32"] = llama_perplexity(info, f32, text, n_ctx, core, base)
        _, ll_tokens = read_llamacpp_tokens(base)
    for name, gguf in (("bf16", bf16), ("q4_0", q4_0)):
        result["llama_cpp"][name] = llama_perplexity(info, gguf, text, n_ctx, core)
    tok = Tokenizer(model_dir, json.loads((model_dir / "config.json").read_text())["bos_token_id"])
    ours = tok.encode(text.read_text())
    usable = len(ll_tokens)
    result["tokens"] = {"pdserve": len(ours), "llama_cpp_scored_span": usable,
                        "identical_over_span": ours[:usable] == ll_tokens,
                        "first_mismatch": next((i for i, (a, b) in enumerate(zip(ours, ll_tokens)) if a != b), None)}
    log(f"tokens: pdserve {len(ours)}, llama.cpp chunks cover {usable}; identical: "
        f"{result['tokens']['identical_over_span']}")
    # score on llama.cpp's ids (identical where the check above says so); its tail beyond the chunks is dropped
    # anyway, so padding with our own ids only keeps the chunk count, it never enters a score
    tokens = ll_tokens + ours[usable:]
    for name, dtype, weights in PDSERVE_VARIANTS:
        try:
            fn = pdserve_logits_fn(model_dir, dtype, weights, n_ctx)
        except (ValueError, RuntimeError, NotImplementedError) as e:   # a variant the loader refuses
            result["pdserve"][name] = {"error": repr(e)}
            continue
        result["pdserve"][name] = chunked_perplexity(fn, tokens, n_ctx, tok.bos_token_id)
        if name in ("fp32", "int4"):     # and on pdserve's own (transformers') tokenization of the same text
            result["pdserve"][f"{name}_own_tokens"] = chunked_perplexity(fn, ours, n_ctx, tok.bos_token_id)
    for name, r in result["llama_cpp"].items():
        log(f"llama.cpp {name:5s}: PPL {r['ppl']:.4f} +/- {r['err']:.4f}")
    for name, r in result["pdserve"].items():
        log(f"pdserve   {name:9s}: " + (f"PPL {r['ppl']:.4f} over {r['num_scored']} tokens"
                                        if "ppl" in r else r["error"]))
    fp32, ll32 = result["pdserve"]["fp32"]["ppl"], result["llama_cpp"]["f32"]["ppl"]
    result["protocol_match_rel"] = fp32 / ll32 - 1
    if "ppl" in result["pdserve"]["int4"]:
        result["int4_vs_q4_0_rel"] = result["pdserve"]["int4"]["ppl"] / result["llama_cpp"]["q4_0"]["ppl"] - 1
    log(f"protocol check pdserve fp32 / llama.cpp f32 - 1 = {result['protocol_match_rel']:+.4%}; "
        f"INT4 / Q4_0 - 1 = {result.get('int4_vs_q4_0_rel', float('nan')):+.4%}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctx", type=int, default=256, help="chunk length (the model has 512 positions)")
    ap.add_argument("--core", type=int, default=1)
    ap.add_argument("--text", default=str(TEXT))
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "peers" / "perplexity"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    result = compare(args.ctx, args.core, Path(args.text))
    from pdserve.bench.common import write_result
    write_result(result, Path(args.out))


if __name__ == "__main__":
    main()
