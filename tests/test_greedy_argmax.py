"""Greedy sampling's argmax in C (``fused.c: pd_argmax_rows``): torch's index on ties, NaN and -inf,
and :func:`model.sampling.sample` taking it for large CPU logits with the same result."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.kernels.cpu import available
from pdserve.kernels.cpu import fused as cfused
from pdserve.model import sampling
from pdserve.model.sampling import SamplingParams, sample

needs_fused = pytest.mark.skipif(not available("fused"), reason="no C compiler")


@needs_fused
@settings(max_examples=300, deadline=None)
@given(rows=st.integers(1, 5), vocab=st.integers(1, 70), seed=st.integers(0, 2**31), ties=st.booleans(),
       specials=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 69),
                                   st.sampled_from([float("nan"), float("inf"), float("-inf")])), max_size=4))
def test_argmax_rows_picks_the_index_torch_picks(rows, vocab, seed, ties, specials):
    """First maximum on ties, the first NaN over any maximum, 0 on a row of -inf: torch.argmax's choice,
    over widths on both sides of the 16-lane vectors, on a strided view."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(rows, vocab + 3, generator=g)
    if ties:
        full = full.round()                               # many equal maxima
    for r, c, v in specials:
        if r < rows and c < vocab:
            full[r, c] = v
    x = full[:, :vocab]
    assert torch.equal(cfused.argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(cfused.argmax_rows(torch.full((2, vocab), float("-inf"))), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="float32"):
        cfused.argmax_rows(x.bfloat16())


@needs_fused
def test_sample_takes_the_c_argmax_for_large_logits_and_agrees_with_torch(monkeypatch):
    """Rows of many equal maxima over a vocabulary above ``GREEDY_C_MIN``: ``sample`` returns torch's
    argmax, and it got there through ``argmax_rows`` where the vector build runs."""
    logits = torch.randn(4, 4096).round()
    logits[2, 100:] = logits[2].max()                    # a tie far from the row's start
    calls = []
    real = sampling.argmax_rows
    monkeypatch.setattr(sampling, "argmax_rows", lambda x: calls.append(x.shape) or real(x))
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    assert sample(logits, [greedy] * 4, [0] * 4) == logits.argmax(dim=-1).tolist()
    assert calls == ([(4, 4096)] if cfused.vectorized() else [])
