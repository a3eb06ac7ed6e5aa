"""bf16 linear layers for CPU decode over weights packed once for AVX512-BF16 and AMX.

A decode step multiplies a handful of rows by every weight, so its speed is the speed at
which weights stream from memory. At one row torch's bf16 ``F.linear`` reaches about half
of this machine's read bandwidth; the packed kernels (:mod:`kernels.cpu.gemv`) reach it:

    rows            kernel                                  ms per bench-80m step of projections, one thread
    1 .. 2          vdpbf16ps gemv       (gemv_bf16)        10.2 at 1 row   (F.linear 17.1)
    3 .. 96         AMX tiles            (gemm_bf16_amx)    13.6 at 32 rows (F.linear 21.0)
    more, or no AMX F.linear on the dense weight (oneDNN)   (AMX re-reads the weights every 32 rows)

(``python bench/cpu_kernels.py``; docs/benchmarks.md). :class:`PackedBF16Linear` keeps the
dense weight for the last case (prefill chunks of the colocated worker): the decode worker's
bf16 projections take twice their size in memory. Each kernel's output row depends only on
its input row; the gemv and AMX kernels sum in different orders, so a request's bf16 logits
can differ in the last bit between a step of at most 2 rows and a larger one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu.gemv import gemm_amx_available, gemv_available, pack_weight, run_unchecked

GEMV_MAX_ROWS = 2    # bench/cpu_kernels.py: gemv 11.7 vs AMX 11.9 ms per bench-80m step at 2 rows, 12.6 vs 12.0 at 3
AMX_MAX_ROWS = 96    # AMX 30.9 vs F.linear 34.1 ms at 96 rows (23.2 vs 28.7 at 64); larger: prefill chunks
TARGET_MODULES = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj", "lm_head")


class PackedBF16Linear(nn.Module):
    """A bf16 ``nn.Linear`` whose decode-sized products run on the packed weight.

    Input ``[..., in_features]`` bf16, output ``[..., out_features]`` bf16, float32 accumulation
    and one rounding. The dense ``weight`` is kept (shared, not copied, when tied) for steps of
    more than :data:`AMX_MAX_ROWS` rows.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if linear.weight.dtype != torch.bfloat16 or linear.weight.device.type != "cpu":
            raise ValueError(f"PackedBF16Linear needs a bf16 CPU weight, got {linear.weight.dtype} "
                             f"on {linear.weight.device}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.register_buffer("packed", pack_weight(linear.weight), persistent=False)
        self.max_rows = AMX_MAX_ROWS if gemm_amx_available() and self.in_features % 32 == 0 else GEMV_MAX_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > self.max_rows or x.dtype != torch.bfloat16:
            return F.linear(x, self.weight, self.bias)
        x2 = x.reshape(rows, self.in_features)
        if self.in_features % 2:
            x2 = F.pad(x2, (0, 1))
        elif x2.stride(1) != 1:
            x2 = x2.contiguous()
        y = run_unchecked(x2, self.packed, self.out_features, amx=rows > GEMV_MAX_ROWS)
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)


def pack_for_cpu_decode(model: nn.Module) -> int:
    """Swap the decoder layers' bf16 projections and the LM head for :class:`PackedBF16Linear` in place
    (a tied head gets a packed copy; the embedding keeps the dense weight).

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
        setattr(parent, attr, PackedBF16Linear(module))
        swapped += 1
    return swapped
