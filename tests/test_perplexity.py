"""bench/perplexity.py: llama-perplexity's chunked protocol, checked against a direct transformers computation."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.bench.perplexity import chunked_perplexity, pdserve_logits_fn
from pdserve.deploy.make_model import make_model

N_CTX = 32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_model("tiny-llama", tmp_path_factory.mktemp("ppl") / "tiny", dtype="float32")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = [1] + torch.randint(3, 2048, (3 * N_CTX + 7,), generator=torch.Generator().manual_seed(0)).tolist()
    return path, hf, tokens


def _hf_logits(hf):
    def fn(chunk: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf(torch.tensor([chunk])).logits[0]
    return fn


def _direct(hf, tokens: list[int], n_ctx: int, bos: int) -> tuple[float, int]:
    """The same quantity written out independently: per chunk, BOS first, cross-entropy of the second half."""
    losses = []
    for start in range(0, len(tokens) - n_ctx + 1, n_ctx):
        ids = torch.tensor([[bos] + tokens[start + 1:start + n_ctx]])
        with torch.no_grad():
            logits = hf(ids).logits[0].double()
        half = n_ctx // 2
        losses.append(torch.nn.functional.cross_entropy(logits[half:-1], torch.tensor(tokens[start + half + 1:
                                                                                             start + n_ctx]),
                                                        reduction="none"))
    all_losses = torch.cat(losses)
    return math.exp(all_losses.mean().item()), all_losses.numel()


def test_protocol_equals_direct_transformers(tiny):
    path, hf, tokens = tiny
    got = chunked_perplexity(_hf_logits(hf), tokens, N_CTX, bos_id=1)
    want, count = _direct(hf, tokens, N_CTX, 1)
    assert got["num_chunks"] == 3                          # the 8-token tail is dropped
    assert got["num_scored"] == count == 3 * (N_CTX - N_CTX // 2 - 1)
    assert got["ppl"] == pytest.approx(want, rel=1e-12)


def test_chunk_start_is_replaced_by_bos(tiny):
    _, hf, tokens = tiny
    changed = list(tokens)
    changed[N_CTX] = 7                                     # second chunk's first token: BOS replaces it
    a = chunked_perplexity(_hf_logits(hf), tokens, N_CTX, bos_id=1)
    b = chunked_perplexity(_hf_logits(hf), changed, N_CTX, bos_id=1)
    assert a["ppl"] == b["ppl"]
    c = chunked_perplexity(_hf_logits(hf), changed, N_CTX, bos_id=None)   # without BOS it counts
    assert c["ppl"] != a["ppl"]


def test_pdserve_fp32_matches_transformers(tiny):
    path, hf, tokens = tiny
    ours = chunked_perplexity(pdserve_logits_fn(path, "float32", "native", N_CTX), tokens, N_CTX, bos_id=1)
    want, _ = _direct(hf, tokens, N_CTX, 1)
    assert ours["ppl"] == pytest.approx(want, rel=1e-4)


def test_too_few_tokens_raises(tiny):
    _, hf, tokens = tiny
    with pytest.raises(ValueError):
        chunked_perplexity(_hf_logits(hf), tokens[:2 * N_CTX - 1], N_CTX, bos_id=1)
