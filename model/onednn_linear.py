"""bf16 projections of prefill chunks through oneDNN on a weight reordered once, as torch.compile's freezing pass
(inductor's mkldnn weight prepacking) does for CPU linear layers.

``F.linear`` on a bf16 CPU weight hands oneDNN the plain ``[N, K]`` weight at every call, and oneDNN reorders it
into its blocked layout each time: one more pass over the weight per projection. Reordered once at load
(``torch.ops.mkldnn._reorder_linear_weight``) and multiplied by ``torch.ops.mkldnn._linear_pointwise``, the same
oneDNN primitive runs without it, bit-identical to ``F.linear`` at every row count. bench-80m's projections
at 512 rows on the AMX Xeon (family 6, model 167), one core, ms per call: qkv 0.84 -> 0.63, o_proj 0.46 -> 0.38,
down_proj 1.64 -> 1.20, gate_up 2.66 -> 2.69 (``bench/limits.py`` measures both as ``f_linear`` and
``onednn_prepacked``). A prefill worker takes it where its projections stay on ``F.linear``
(:func:`model.cpu_linear.dense_beats_packed_for_prefill`: on AMX CPUs), and a colocated decode worker wherever
this prepacking runs, for the prefill chunks' rows beyond its packed kernels
(:class:`model.cpu_linear.PackedBF16Linear`'s ``prepack``; on Zen 5 2-5% ahead of ``F.linear`` on bench-80m's
four shapes at 512 and 2,048 rows, ``docs/results/prefill_zen5_1128.json``).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from pdserve.model.linear_swap import LAYER_MODULES, TARGET_MODULES, swap_bf16_linears

KERNEL = "onednn-prepacked"


@functools.cache
def onednn_prepack_available() -> bool:
    """Whether torch's oneDNN weight prepacking runs here for bf16 (its ops exist and oneDNN takes bf16 on this
    CPU: AVX-512 and newer)."""
    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise") and ops._is_mkldnn_bf16_supported()):
        return False
    try:
        w = torch.ones(16, 32, dtype=torch.bfloat16)
        y = ops._linear_pointwise(torch.ones(2, 32, dtype=torch.bfloat16), ops._reorder_linear_weight(w, 2),
                                  None, "none", [], "")
    except RuntimeError:
        return False
    return bool((y == 32).all())


class OneDNNLinear(nn.Module):
    """A bf16 ``nn.Linear`` whose weight is held in oneDNN's blocked layout, reordered once for steps of about
    ``rows_hint`` rows (any row count runs, bit-identical to ``F.linear``).

    Input ``[..., in_features]`` bf16 CPU; output ``[..., out_features]`` bf16. The dense weight is not kept
    (the packed one is an opaque oneDNN tensor, outside ``parameters()``); the bias is.

    Raises:
        ValueError: at construction, a weight that is not bf16 on the CPU; at a call, an input that is not.
    """

    def __init__(self, linear: nn.Linear, rows_hint: int = 512) -> None:
        super().__init__()
        if linear.weight.dtype != torch.bfloat16 or linear.weight.device.type != "cpu":
            raise ValueError(f"OneDNNLinear needs a bf16 CPU weight, got {linear.weight.dtype} on "
                             f"{linear.weight.device}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows_hint)

    def kernel_for(self, rows: int) -> str:
        """The kernel every row count runs on (recorded by the benchmarks next to their numbers)."""
        return KERNEL

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.device.type != "cpu":
            raise ValueError(f"OneDNNLinear takes bf16 CPU inputs, got {x.dtype} on {x.device}")
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def prepack_for_cpu_prefill(model: nn.Module, rows_hint: int = 512) -> int:
    """Swap the decoder layers' bf16 ``nn.Linear`` projections, and an untied LM head, for :class:`OneDNNLinear`
    in place. A head tied to the embedding stays as it is: a packed copy would add vocab x hidden bytes to
    speed up one row per prefill chunk (the last token's; bench-80m's head on that row: 0.28 ms prepacked,
    0.50 with ``F.linear``). A no-op (returns 0) where :func:`onednn_prepack_available` is false; modules
    already converted or of another dtype or device stay. Returns the number swapped."""
    if not onednn_prepack_available():
        return 0
    head, embed = getattr(model, "lm_head", None), getattr(model, "embed_tokens", None)
    tied = head is not None and embed is not None and head.weight is embed.weight
    return swap_bf16_linears(model, lambda name, linear: OneDNNLinear(linear, rows_hint),
                             LAYER_MODULES if tied else TARGET_MODULES)
