"""FP8 (e4m3) W8A8 linear layers for the prefill worker.

Scheme (vLLM's ``fp8`` W8A8 with per-token dynamic activation scales and
per-output-channel weight scales; format from Micikevicius et al., "FP8 Formats for
Deep Learning", 2022, ``float8_e4m3fn``: max finite 448, no infinities)::

    weight  W [N, K]  ->  Wq = sat_e4m3(W / sw[:, None]),  sw[n] = amax_k |W[n, k]| / 448   (once, at load)
    input   x [M, K]  ->  xq = sat_e4m3(x / sx[:, None]),  sx[m] = amax_k |x[m, k]| / 448   (every call, per token)
    y[m, n] = (sum_k xq[m, k] * Wq[n, k]) * sx[m] * sw[n]  (+ b[n])       fp32 accumulator, output in x.dtype

``sat_e4m3`` clamps to [-448, 448] before the round-to-nearest-even cast (older torch casts
map out-of-range values to NaN). Scales are fp32; an all-zero row (amax 0) uses
amax 1e-12 so its scale stays a normal fp32 number and its codes are 0, not NaN.
Non-finite inputs give non-finite rows.

Per-token scales keep a token's quantized operands independent of the other tokens
in the batch (an outlier token does not coarsen its neighbours), so batch composition
does not change a token's numerics (beyond fp32 summation order).

Execution paths of :class:`Fp8Linear`:

* CUDA, compute capability >= 8.9 (Ada, Hopper, Blackwell): ``torch._scaled_mm``
  (cuBLASLt FP8 tensor cores). The weight is zero-padded once to multiples of 16
  in N and K and kept ``[N, K]`` row-major, i.e. ``Wq.t()`` is the column-major
  second operand ``_scaled_mm`` requires; activations are zero-padded in K per call.
  bf16 inputs use row-wise scales fused in cuBLASLt (bf16 out); other dtypes (or a
  torch without row-wise support) get the raw fp32 accumulator (unit scales) and the
  scales are applied in torch.
* other CUDA: the Triton kernel :func:`kernels.fp8_gemm_triton.fp8_gemm_triton`
  (fp8 bytes decoded in-kernel, fp32 accumulation, scales and bias in the epilogue).
* CPU: there is no fast FP8 matmul on CPU (``torch._scaled_mm`` exists for CPU in
  torch 2.13 but is a slow reference: 2600-2900x slower than an fp32 matmul here), so the
  same quantize -> dequantize numerics run through an ordinary matmul. **This gives
  real FP8 accuracy but no speed-up** (it is slower than the unquantized layer:
  activation quantization is extra work, and it keeps a dequantized copy of the weight,
  so no memory saving either). The matmul runs on the e4m3 *values* (exact in fp32 and in
  bf16) with the scales applied afterwards, exactly like the GPU epilogue. By default it
  is an fp32 matmul: every e4m3 product is exact in fp32 and the sums are fp32, i.e. the
  GPU kernels' fp32 accumulator. A bf16 matmul (``cpu_matmul_dtype=torch.bfloat16``)
  also accumulates in fp32 inside oneDNN but torch's CPU ``mm`` has no fp32-output
  variant, so its result is rounded to bf16 *before* the scales: ~2**-9 relative error
  per output on top of FP8 (3.4e-3 of max|y| measured on a 64x128x384 product, against
  1.2e-7 for fp32), which the GPU paths do not have; on TinyStories it raises the mean
  first-token KL to fp32 from 0.0198 to 0.0213 nats (same top-1). bf16 is only faster
  here for large M (AMX), so fp32 is the default.

``convert_for_runtime(model)`` swaps the four projections of every decoder layer;
``lm_head`` and the embeddings stay in high precision.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

E4M3_MAX = 448.0           # largest finite float8_e4m3fn (1.75 * 2**8)
_AMAX_FLOOR = 1e-12        # amax of all-zero rows: keeps the scale finite and normal
_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def to_e4m3_saturating(x: torch.Tensor) -> torch.Tensor:
    """Already-scaled values -> ``float8_e4m3fn``, clamping to [-448, 448] first (+-inf -> +-448).

    The format has no inf; older torch casts (c10 ``Float8_e4m3fn`` before it learned to
    saturate) turned out-of-range values into the NaN code 0x7F, so the clamp makes saturation
    independent of the torch version and device. NaN stays NaN. Rounding: nearest, ties to even.
    """
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric FP8 quantization along the last dim.

    Args:
        x: ``[..., K]`` any float dtype.
    Returns:
        ``(q, scale)``: ``q`` ``[..., K]`` ``float8_e4m3fn`` = ``sat(x / scale)`` rounded to
        nearest even; ``scale`` ``[...]`` fp32 = ``max(amax_row, 1e-12) / 448``, so that
        ``q.float() * scale[..., None]`` approximates ``x`` (relative error <= 2**-4 for
        values in the e4m3 normal range, i.e. >= 2**-6 * scale).
    """
    x = x.float()
    amax = x.abs().amax(dim=-1).clamp(min=_AMAX_FLOOR)
    scale = amax / E4M3_MAX
    q = to_e4m3_saturating(x / scale.unsqueeze(-1))
    return q, scale


def dequantize_e4m3(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q`` ``[..., K]`` e4m3 and ``scale`` ``[...]`` fp32 -> ``[..., K]`` fp32 ``q * scale``."""
    return q.float() * scale.unsqueeze(-1)


@functools.lru_cache(maxsize=None)
def _has_fp8_tensor_cores(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9) and hasattr(torch, "_scaled_mm")


def _pad_bytes(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad an e4m3 matrix to ``[rows, cols]`` (byte 0x00 is +0.0), contiguous."""
    r, c = t.shape
    if (r, c) == (rows, cols):
        return t.contiguous()
    return F.pad(t.view(torch.uint8), (0, cols - c, 0, rows - r)).view(torch.float8_e4m3fn)


def _round16(n: int) -> int:
    return -(-n // 16) * 16


class Fp8Linear(nn.Module):
    """``nn.Linear`` replacement with e4m3 weights and per-token dynamic e4m3 activations.

    Buffers:
        weight: ``[out_features, in_features]`` ``float8_e4m3fn``.
        weight_scale: ``[out_features]`` fp32, per output channel (``amax / 448``).
        bias: ``[out_features]`` in the original dtype, or ``None``.

    ``forward`` maps ``[..., in_features]`` (fp32/bf16/fp16) to ``[..., out_features]`` of the
    same dtype. On CPU this gives real FP8 accuracy but **no speed-up** (see the module
    docstring); on CUDA it uses FP8 tensor cores (>= sm89) or the Triton kernel.

    Args (constructor; use :meth:`from_linear`):
        cpu_matmul_dtype: ``torch.float32`` (default, the GPU's fp32 accumulator exactly)
            or ``torch.bfloat16`` (output rounded to bf16 before scaling) for the CPU path.
    """

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 cpu_matmul_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2 or weight_scale.shape != weight.shape[:1]:
            raise ValueError(f"Fp8Linear: weight {weight.dtype} {tuple(weight.shape)}, "
                             f"weight_scale {tuple(weight_scale.shape)}")
        if cpu_matmul_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"cpu_matmul_dtype must be float32 or bfloat16, got {cpu_matmul_dtype}")
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale.float())
        self.register_buffer("bias", bias)
        self.cpu_matmul_dtype = cpu_matmul_dtype
        self._cpu_weight: torch.Tensor | None = None    # [N, K] e4m3 values in cpu_matmul_dtype
        self._padded: tuple[torch.Tensor, torch.Tensor] | None = None  # _scaled_mm weight, scale
        self._rowwise_ok = True

    @classmethod
    def from_linear(cls, linear: nn.Linear, cpu_matmul_dtype: torch.dtype = torch.float32) -> "Fp8Linear":
        """Quantize ``linear``'s weight once (per output channel); keep its bias as is."""
        with torch.no_grad():
            q, scale = quantize_e4m3(linear.weight.detach())
            bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(q, scale, bias, cpu_matmul_dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weight=float8_e4m3fn per-channel, act=per-token dynamic")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        if k != self.in_features:
            raise ValueError(f"Fp8Linear: input has {k} features, expected {self.in_features}")
        x2 = x.reshape(-1, k)
        if x2.shape[0] == 0:
            return x.new_zeros(*lead, self.out_features)
        xq, sx = quantize_e4m3(x2)
        on_cuda = x.is_cuda
        if on_cuda and _has_fp8_tensor_cores(torch.cuda.current_device() if x.device.index is None
                                             else x.device.index):
            y = self._scaled_mm(xq, sx, x.dtype)
        elif on_cuda:
            from kernels.fp8_gemm_triton import fp8_gemm_triton  # Triton only where it can run
            y = fp8_gemm_triton(xq, sx, self.weight.t(), self.weight_scale, out_dtype=x.dtype, bias=self.bias)
        else:
            y = self._cpu_mm(xq, sx, x.dtype)
        return y.reshape(*lead, self.out_features)

    def _epilogue(self, acc: torch.Tensor, sx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """fp32 ``acc`` ``[M, N]`` -> ``acc * sx[:, None] * sw[None, :] (+ b)`` in ``dtype``."""
        y = acc * sx[:, None] * self.weight_scale[None, :]
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(dtype)

    def _cpu_mm(self, xq: torch.Tensor, sx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """CPU emulation: e4m3 values (exact in fp32/bf16) through a plain matmul; no speed-up."""
        dt = self.cpu_matmul_dtype
        if self._cpu_weight is None or self._cpu_weight.device != self.weight.device:
            self._cpu_weight = self.weight.to(dt)
        acc = (xq.to(dt) @ self._cpu_weight.t()).float()
        return self._epilogue(acc, sx, dtype)

    def _scaled_mm(self, xq: torch.Tensor, sx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """cuBLASLt FP8 GEMM; N and K padded to multiples of 16 (its layout requirement)."""
        n, k = self.weight.shape
        np_, kp = _round16(n), _round16(k)
        if self._padded is None or self._padded[0].device != xq.device:
            w = _pad_bytes(self.weight, np_, kp)                       # [Np, Kp] row-major
            self._padded = (w, F.pad(self.weight_scale, (0, np_ - n)))  # pad scale with 0: padded cols -> 0
        w, sw = self._padded
        a = _pad_bytes(xq, xq.shape[0], kp)                            # [M, Kp] row-major
        if dtype == torch.bfloat16 and self._rowwise_ok:
            try:  # scales fused in cuBLASLt: out = (a @ w.T) * sx[:, None] * sw[None, :]
                y = torch._scaled_mm(a, w.t(), scale_a=sx[:, None].contiguous(), scale_b=sw[None, :].contiguous(),
                                     out_dtype=torch.bfloat16)[:, :n]
                return y if self.bias is None else (y.float() + self.bias.float()).to(dtype)
            except RuntimeError:  # torch/GPU without row-wise FP8 scaling
                self._rowwise_ok = False
        one = torch.ones((), dtype=torch.float32, device=a.device)
        acc = torch._scaled_mm(a, w.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)[:, :n]
        return self._epilogue(acc, sx, dtype)


@torch.no_grad()
def convert_for_runtime(model: nn.Module, cpu_matmul_dtype: torch.dtype = torch.float32) -> None:
    """Swap every decoder layer's ``qkv_proj``, ``o_proj``, ``gate_up_proj`` and ``down_proj``
    for :class:`Fp8Linear`, in place (weights quantized now, on their current device).

    ``lm_head`` and ``embed_tokens`` stay in high precision (the tied embedding is
    shared with the head, and logits are the most quantization-sensitive matmul).
    Already-converted layers are left alone, so calling twice is harmless.
    On CPU the result is accurate FP8 numerics **without** any speed-up.
    """
    for layer in model.layers:
        for path in _PROJECTIONS:
            parent_name, attr = path.split(".")
            parent = getattr(layer, parent_name)
            mod = getattr(parent, attr)
            if isinstance(mod, nn.Linear):
                setattr(parent, attr, Fp8Linear.from_linear(mod, cpu_matmul_dtype))
