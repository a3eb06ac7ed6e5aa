"""Online model of a decode worker's step time, for predicting TPOT before admitting a request.

One decode step (one token for every request in the batch) takes, in seconds::

    step_s = a + b * batch_size + c * context_tokens
             │   │                └─ attention reads every cached token (s/token)
             │   └─ per-request work: sampling, bookkeeping, weight reuse (s/request)
             └─ fixed cost: reading the weights, launch overhead (s)

``context_tokens`` is the sum of the batch's context lengths (prompt + generated so far).
DistServe (Zhong et al., OSDI 2024; its latency model, appendix) models decode latency as linear
in the batch size and its total context length; without speculation a request's TPOT is one step.

Fit: non-negative least squares over the last ``window`` observations (a sliding window, so
the model follows drift). With three unknowns the exact NNLS solution is the best
unconstrained fit over the supports {a, b, c} and their subsets whose coefficients are all
non-negative, so coefficients, and predictions, are never negative. Before
``min_observations`` the model is a constant: the mean observed step, or ``prior_step_s``.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

# Column subsets tried by the NNLS fit, the full model first (if feasible it is optimal).
_SUPPORTS = ((0, 1, 2), (0, 1), (0, 2), (1, 2), (0,), (1,), (2,))


class StepTimeModel:
    """``step_s = a + b * batch_size + c * context_tokens``, fitted online.

    Args:
        window: observations kept (the fit uses only these).
        min_observations: below this many the model is a constant (mean observed step).
        prior_step_s: the constant before any observation (seconds).
    """

    def __init__(self, window: int = 256, min_observations: int = 8, prior_step_s: float = 0.02) -> None:
        if window < 3 or min_observations < 3 or min_observations > window:
            raise ValueError(f"need 3 <= min_observations <= window, got {min_observations}, {window}")
        if not prior_step_s >= 0:
            raise ValueError(f"prior_step_s must be >= 0, got {prior_step_s}")
        self.min_observations, self.prior_step_s = min_observations, prior_step_s
        self._obs: deque[tuple[float, float, float]] = deque(maxlen=window)
        self._coef = (prior_step_s, 0.0, 0.0)
        self._dirty = False

    @property
    def num_observations(self) -> int:
        return len(self._obs)

    @property
    def fitted(self) -> bool:
        """Whether the linear fit is in use (else a constant)."""
        return len(self._obs) >= self.min_observations

    def observe(self, batch_size: int, context_tokens: int, step_seconds: float) -> None:
        """Record one decode step: ``batch_size`` requests holding ``context_tokens`` tokens in
        total took ``step_seconds``. Invalid observations (empty batch, non-positive or
        non-finite time, negative context) are ignored."""
        if not (batch_size >= 1 and context_tokens >= 0 and math.isfinite(step_seconds) and step_seconds > 0):
            return
        self._obs.append((float(batch_size), float(context_tokens), float(step_seconds)))
        self._dirty = True

    def coefficients(self) -> tuple[float, float, float]:
        """``(a [s], b [s/request], c [s/token])``, all >= 0; refitted lazily after new data."""
        if self._dirty:
            self._coef, self._dirty = self._fit(), False
        return self._coef

    def predict_step(self, batch_size: int, context_tokens: int) -> float:
        """Predicted seconds of one decode step for this batch (>= 0)."""
        a, b, c = self.coefficients()
        return max(0.0, a + b * batch_size + c * context_tokens)

    def predict_tpot(self, batch_size: int, context_tokens: int) -> float:
        """Predicted time per output token (seconds) of every request in a batch of
        ``batch_size`` requests holding ``context_tokens`` tokens: one step."""
        return self.predict_step(batch_size, context_tokens)

    def _fit(self) -> tuple[float, float, float]:
        if not self._obs:
            return (self.prior_step_s, 0.0, 0.0)
        data = np.asarray(self._obs)
        y = data[:, 2]
        if len(y) < self.min_observations:
            return (float(y.mean()), 0.0, 0.0)
        x = np.column_stack([np.ones(len(y)), data[:, 0], data[:, 1]])
        scale = x.max(axis=0)  # columns to ~1 for conditioning (context runs to 1e5)
        scale[scale == 0] = 1.0
        xs = x / scale
        best, best_err = None, math.inf
        for support in _SUPPORTS:
            cols = list(support)
            sol = np.linalg.lstsq(xs[:, cols], y, rcond=None)[0]
            if (sol < 0).any():
                continue
            err = float(np.sum((xs[:, cols] @ sol - y) ** 2))
            if err < best_err * (1 - 1e-9):
                coef = np.zeros(3)
                coef[cols] = sol
                best, best_err = coef / scale, err
            if support == _SUPPORTS[0] and best is not None:
                break  # the unconstrained optimum is feasible
        a, b, c = (float(v) for v in best)  # (0,) alone is always feasible: y > 0
        return (a, b, c)
