"""bf16 linear layers for CPU decode over weights packed once for AVX512-BF16 and AMX.

A decode step multiplies a handful of rows by every weight, so its speed is the speed at
which weights stream from memory. At one row torch's bf16 ``F.linear`` reaches about half
of this machine's read bandwidth; the packed kernels (:mod:`kernels.cpu.gemv`) reach it:

    rows            kernel                                  ms per bench-80m step of projections, one thread
    1 .. 2          vdpbf16ps gemv       (gemv_bf16)        10.5 at 1 row    (F.linear 18.9)
    3 .. 256        AMX tiles            (gemm_bf16_amx)    13.7 at 32 rows  (F.linear 21.5)
    more            F.linear on a dense copy, if kept       89.3 at 512 rows (AMX 108.8)

(``python bench/cpu_kernels.py``; docs/benchmarks.md). A decode worker drops the dense weights
once packed (AMX takes any row count, at 512 rows 22% slower than oneDNN); a colocated one keeps
them for its prefill chunks, and a CPU without AMX keeps them for everything beyond 2 rows.
Each kernel's output row depends only on its input row; the gemv and AMX kernels sum in
different orders, so a request's bf16 logits can differ in the last bit between a step of at
most 2 rows and a larger one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.cpu.gemv import gemm_amx_available, gemv_available, pack_weight, run_unchecked, unpack_weight

GEMV_MAX_ROWS = 2    # bench/cpu_kernels.py: gemv 11.9 vs AMX 12.9 ms per bench-80m step at 2 rows; crossover 2-4
AMX_MAX_ROWS = 256   # with a dense copy: AMX 53.7 vs F.linear 66.6 ms at 256 rows, 108.8 vs 89.3 at 512
TARGET_MODULES = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj", "lm_head")


class PackedBF16Linear(nn.Module):
    """A bf16 ``nn.Linear`` whose products run on the packed weight.

    Input ``[..., in_features]`` bf16, output ``[..., out_features]`` bf16, float32 accumulation
    and one rounding (a bias is added after it: a second rounding, where ``F.linear`` has one).
    Args: ``linear`` (bf16, CPU); ``keep_dense``: also keep its dense weight
    (shared, not copied, when tied) for steps of more than :data:`AMX_MAX_ROWS` rows, where
    ``F.linear`` is faster (prefill chunks of a colocated worker). Without AMX (or an input width
    that is not a multiple of 32) the dense weight is always kept: the gemv serves only a few rows.

    Raises:
        ValueError: ``linear``'s weight is not bf16 on the CPU.
    """

    def __init__(self, linear: nn.Linear, keep_dense: bool = True) -> None:
        super().__init__()
        if linear.weight.dtype != torch.bfloat16 or linear.weight.device.type != "cpu":
            raise ValueError(f"PackedBF16Linear needs a bf16 CPU weight, got {linear.weight.dtype} "
                             f"on {linear.weight.device}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.amx = gemm_amx_available() and self.in_features % 32 == 0
        self.weight = linear.weight if keep_dense or not self.amx else None
        self.bias = linear.bias
        self.register_buffer("packed", pack_weight(linear.weight), persistent=False)
        # rows up to which the packed kernels run; beyond, F.linear on the dense weight if there is one
        self.max_rows = GEMV_MAX_ROWS if not self.amx else AMX_MAX_ROWS if self.weight is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if x.dtype != torch.bfloat16 or (self.max_rows is not None and rows > self.max_rows):
            dense = self.weight if self.weight is not None else unpack_weight(
                self.packed, self.out_features, self.in_features)
            return F.linear(x, dense.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        x2 = x.reshape(rows, self.in_features)
        if self.in_features % 2:
            x2 = F.pad(x2, (0, 1))
        elif x2.stride(1) != 1:
            x2 = x2.contiguous()
        y = run_unchecked(x2, self.packed, self.out_features, amx=rows > GEMV_MAX_ROWS)
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)


def pack_for_cpu_decode(model: nn.Module, keep_dense: bool = False) -> int:
    """Swap the decoder layers' bf16 projections and the LM head for :class:`PackedBF16Linear` in place
    (a tied head gets a packed copy; the embedding keeps the dense weight). ``keep_dense``: see
    :class:`PackedBF16Linear` (a colocated worker keeps it for its prefill chunks).

    A no-op (returns 0) where the kernel cannot run (no compiler, no AVX512-BF16), for
    non-bf16 or non-CPU weights, and for already converted modules. Returns the number swapped.
    """
    if not gemv_available():
        return 0
    swapped = 0
    for name, module in list(model.named_modules()):
        if not name.endswith(TARGET_MODULES) or type(module) is not nn.Linear:
            continue
        if module.weight.dtype != torch.bfloat16 or module.weight.device.type != "cpu":
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, attr, PackedBF16Linear(module, keep_dense))
        swapped += 1
    return swapped
