"""The multi-step loop's sampling rule in C (``decode_stack.c: temperature_argmax``, through the test
entry ``pd_temperature_argmax``) against :func:`model.sampling.temperature_draw`: the same token for any
logits (ties, NaN, +-inf, +-0), noise, temperature and top-k, including a k-th value shared by many
entries and NaN among the top k (torch.topk ranks NaN above everything)."""

from __future__ import annotations

import ctypes

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.kernels.cpu import available, library
from pdserve.model.sampling import temperature_draw

pytestmark = pytest.mark.skipif(not available("decode_stack"), reason="no C compiler")
SPECIALS = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0]


def _c_draw(logits: torch.Tensor, noise: torch.Tensor, temperature: float, top_k: int) -> int:
    fn = library("decode_stack").pd_temperature_argmax
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int64]
    fn.restype = ctypes.c_int64
    return fn(logits.data_ptr(), noise.data_ptr(), logits.numel(), temperature, top_k)


@settings(max_examples=400, deadline=None)
@given(vocab=st.integers(1, 80), seed=st.integers(0, 2**31), ties=st.booleans(),
       temperature=st.sampled_from([0.3, 0.7, 1.0, 1.3, 2.0, 1e-3]), top_k=st.integers(0, 90),
       specials=st.lists(st.tuples(st.integers(0, 79), st.sampled_from(SPECIALS)), max_size=6))
def test_the_c_rule_picks_the_token_temperature_draw_picks(vocab, seed, ties, temperature, top_k, specials):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, generator=g) * 4
    if ties:
        logits = logits.round()                            # many equal values, a k-th value shared by several
    for c, v in specials:
        if c < vocab:
            logits[c] = v
    noise = torch.empty(vocab).exponential_(generator=g).log_()
    want = temperature_draw(logits, temperature, noise, top_k)
    assert _c_draw(logits.contiguous(), noise.contiguous(), temperature, top_k) == want


def test_a_large_vocabulary_with_top_k():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(151_936, generator=g).round(decimals=1)
    for top_k, temperature in ((1, 1.0), (50, 0.8), (1000, 1.2), (151_935, 1.0)):
        noise = torch.empty(151_936).exponential_(generator=g).log_()
        assert _c_draw(logits, noise, temperature, top_k) == temperature_draw(logits, temperature, noise, top_k)
