"""StepTimeModel: recovers a known linear step time from noisy data, and behaves before it has any."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.router.step_model import StepTimeModel

A, B, C = 0.008, 3e-4, 2e-7  # s, s/request, s/token


def synthetic(rng: np.random.Generator, n: int, coef=(A, B, C), noise: float = 0.02):
    for _ in range(n):
        batch = int(rng.integers(1, 65))
        ctx = int(batch * rng.integers(100, 4000))
        step = (coef[0] + coef[1] * batch + coef[2] * ctx) * (1 + noise * rng.standard_normal())
        yield batch, ctx, step


def test_recovers_known_coefficients_from_noisy_data():
    rng = np.random.default_rng(0)
    m = StepTimeModel(window=400)
    for obs in synthetic(rng, 400):
        m.observe(*obs)
    a, b, c = m.coefficients()
    assert m.fitted
    assert a == pytest.approx(A, rel=0.1) and b == pytest.approx(B, rel=0.15) and c == pytest.approx(C, rel=0.1)
    for batch, ctx in [(1, 500), (16, 16 * 2000), (64, 64 * 3000)]:
        assert m.predict_tpot(batch, ctx) == pytest.approx(A + B * batch + C * ctx, rel=0.03)


def test_before_enough_data_it_is_a_constant():
    m = StepTimeModel(min_observations=8, prior_step_s=0.025)
    assert m.predict_tpot(32, 10_000) == 0.025 and m.coefficients() == (0.025, 0.0, 0.0)
    m.observe(1, 100, 0.010)
    m.observe(50, 90_000, 0.030)
    assert not m.fitted and m.predict_tpot(1, 0) == pytest.approx(0.020) == m.predict_tpot(99, 10**6)
    for bad in [(0, 100, 0.01), (4, -1, 0.01), (4, 100, 0.0), (4, 100, float("nan")), (4, 100, -1.0)]:
        m.observe(*bad)
    assert m.num_observations == 2


def test_never_negative_even_when_the_data_slopes_down():
    m = StepTimeModel(min_observations=4)
    for batch in range(1, 21):  # step time falling with batch (e.g. warm-up): no negative slope allowed
        m.observe(batch, 100 * batch, 0.05 - 0.002 * batch)
    assert all(x >= 0 for x in m.coefficients())
    assert m.predict_tpot(1000, 0) >= 0 and m.predict_tpot(1, 10**7) >= 0


def test_collinear_data_predicts_along_it():
    m = StepTimeModel(min_observations=4)
    for batch in range(1, 33):  # context exactly 1000 per request: b and c cannot be told apart
        m.observe(batch, 1000 * batch, 0.005 + 0.001 * batch)
    assert all(x >= 0 for x in m.coefficients())
    assert m.predict_tpot(40, 40_000) == pytest.approx(0.045, rel=1e-6)


def test_window_follows_drift():
    rng = np.random.default_rng(1)
    m = StepTimeModel(window=100)
    for obs in synthetic(rng, 100, noise=0.0):
        m.observe(*obs)
    for obs in synthetic(rng, 100, coef=(2 * A, 2 * B, 2 * C), noise=0.0):  # e.g. a slower GPU clock
        m.observe(*obs)
    assert m.coefficients() == pytest.approx((2 * A, 2 * B, 2 * C), rel=1e-6)
