"""FP8 (e4m3) W8A8 linear layers for the prefill worker.

Format and scaling (``float8_e4m3fn``; per-token / per-channel as vLLM's ``fp8``, or DeepSeek-V3's
fine-grained ``1 x G`` / ``G x G`` groups): :mod:`model.quant.fp8_format`.

Accuracy (``bench/fp8_accuracy.py``, TinyStories-656K, first token vs fp32, 90 prompts; top-1
/ mean KL): per-channel 91.1% / 0.0198 nats; G=128 84.4% / 0.0177; G=64 91.1% / 0.0195;
G=32 94.4% / 0.0196; G=16 93.3% / 0.0134 (the same four projections in bf16: 100% / 5.6e-5).
e4m3's error is dominated by its 3-bit mantissa (relative rounding error up to 2**-4 at any
scale); finer scales only keep small values out of the subnormals, so they help the KL
moderately and no G reaches the 97% top-1 target (one prompt is 1.1 points: top-1 moves by
noise-level amounts). G=128 equals per-token for the activations of the K=128 projections
and its 128x128 weight blocks are *coarser* than per-channel. The per-channel default keeps
the fused cuBLASLt path; ``group_size=16`` is the more accurate opt-in.

Execution paths of :class:`Fp8Linear`:

* CUDA, compute capability >= 8.9 (Ada, Hopper, Blackwell), ``group_size=None``:
  ``torch._scaled_mm`` (cuBLASLt FP8 tensor cores). The weight is zero-padded once to
  multiples of 16 in N and K and kept ``[N, K]`` row-major, i.e. ``Wq.t()`` is the
  column-major second operand ``_scaled_mm`` requires; activations are zero-padded in K
  per call. bf16 inputs use row-wise scales fused in cuBLASLt (bf16 out); other dtypes (or
  a torch without row-wise support) get the raw fp32 accumulator (unit scales) and the
  scales are applied in torch. Row-wise ``_scaled_mm`` cannot scale per K-group, so with
  ``group_size`` every CUDA GPU uses the Triton kernel below.
* other CUDA, or any CUDA with ``group_size``: the Triton kernel
  :func:`kernels.fp8_gemm_triton.fp8_gemm_triton` (fp8 bytes decoded in-kernel, fp32
  accumulation; per-group scales applied inside its K loop, else in the epilogue).
* CPU: there is no fast FP8 matmul on CPU (``torch._scaled_mm`` exists for CPU in
  torch 2.13 but is a slow reference: 2600-2900x slower than an fp32 matmul here), so the
  same quantize -> dequantize numerics run through an ordinary matmul. **This gives
  real FP8 accuracy but no speed-up** (it is slower than the unquantized layer:
  activation quantization is extra work, and it keeps a dequantized copy of the weight,
  so no memory saving either). Per-channel: the matmul runs on the e4m3 *values* (exact in
  fp32 and in bf16) with the scales applied afterwards, exactly like the GPU epilogue. By
  default it is an fp32 matmul: every e4m3 product is exact in fp32 and the sums are fp32,
  i.e. the GPU kernels' fp32 accumulator. A bf16 matmul (``cpu_matmul_dtype=torch.bfloat16``)
  also accumulates in fp32 inside oneDNN but torch's CPU ``mm`` has no fp32-output
  variant, so its result is rounded to bf16 *before* the scales: ~2**-9 relative error
  per output on top of FP8 (3.4e-3 of max|y| measured on a 64x128x384 product, against
  1.2e-7 for fp32), which the GPU paths do not have; on TinyStories it raises the mean
  first-token KL to fp32 from 0.0198 to 0.0213 nats (same top-1). bf16 is only faster
  here for large M (AMX), so fp32 is the default. With ``group_size`` the fp32 path
  dequantizes both operands with their group scales and does one fp32 matmul (the same
  sum as the per-group one, up to fp32 rounding of ``q * scale``); the bf16 path does one
  bf16 matmul of e4m3 values per K-group, each rounded to bf16 before its scales.

``convert_for_runtime(model)`` swaps the four projections of every decoder layer;
``lm_head`` and the embeddings stay in high precision.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.families import refuse_mixture
from pdserve.model.quant.fp8_format import (
    check_group_size,
    dequantize_e4m3_blocks,
    dequantize_e4m3_groups,
    quantize_e4m3,
    quantize_e4m3_blocks,
    quantize_e4m3_groups,
)

_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


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
    """``nn.Linear`` replacement with e4m3 weights and dynamic e4m3 activations.

    Buffers:
        weight: ``[out_features, in_features]`` ``float8_e4m3fn``.
        weight_scale: fp32 ``amax / 448``; ``[out_features]`` (per output channel) when
            ``group_size`` is None, else ``[ceil(out/G), ceil(in/G)]`` (per ``G x G`` block).
        bias: ``[out_features]`` in the original dtype, or ``None``.

    ``forward`` maps ``[..., in_features]`` (fp32/bf16/fp16) to ``[..., out_features]`` of the
    same dtype; activations are scaled per token (``group_size`` None) or per token per
    ``1 x G`` tile. On CPU this gives real FP8 accuracy but **no speed-up** (see the module
    docstring); on CUDA it uses FP8 tensor cores (>= sm89, per-channel only) or the Triton kernel.

    Args (constructor; use :meth:`from_linear`):
        cpu_matmul_dtype: ``torch.float32`` (default, the GPU's fp32 accumulator exactly)
            or ``torch.bfloat16`` (output rounded to bf16 before scaling) for the CPU path.
        group_size: None (per-token / per-channel) or G, a positive multiple of 16.
    """

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 cpu_matmul_dtype: torch.dtype = torch.float32, group_size: int | None = None) -> None:
        super().__init__()
        if group_size is not None:
            check_group_size(group_size)
        if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
            raise ValueError(f"Fp8Linear: weight {weight.dtype} {tuple(weight.shape)}")
        n, k = weight.shape
        want = (n,) if group_size is None else (-(-n // group_size), -(-k // group_size))
        if tuple(weight_scale.shape) != want:
            raise ValueError(f"Fp8Linear: weight_scale {tuple(weight_scale.shape)}, expected {want} "
                             f"for weight {tuple(weight.shape)}, group_size={group_size}")
        if cpu_matmul_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"cpu_matmul_dtype must be float32 or bfloat16, got {cpu_matmul_dtype}")
        self.out_features, self.in_features = n, k
        self.group_size = group_size
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale.float())
        self.register_buffer("bias", bias)
        self.cpu_matmul_dtype = cpu_matmul_dtype
        self._cpu_weight: tuple[torch.Tensor, ...] | None = None   # see _cpu_operands
        self._padded: tuple[torch.Tensor, torch.Tensor] | None = None  # _scaled_mm weight, scale
        self._rowwise_ok = True

    @classmethod
    def from_linear(cls, linear: nn.Linear, cpu_matmul_dtype: torch.dtype = torch.float32,
                    group_size: int | None = None) -> "Fp8Linear":
        """Quantize ``linear``'s weight once (per output channel, or per ``G x G`` block when
        ``group_size`` is given); keep its bias as is."""
        with torch.no_grad():
            w = linear.weight.detach()
            q, scale = quantize_e4m3(w) if group_size is None else quantize_e4m3_blocks(w, group_size)
            bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(q, scale, bias, cpu_matmul_dtype, group_size)

    def extra_repr(self) -> str:
        g = self.group_size
        gran = ("weight=per-channel, act=per-token" if g is None
                else f"weight={g}x{g} blocks, act=per-token 1x{g} tiles")
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, float8_e4m3fn {gran} (dynamic)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        if k != self.in_features:
            raise ValueError(f"Fp8Linear: input has {k} features, expected {self.in_features}")
        x2 = x.reshape(-1, k)
        if x2.shape[0] == 0:
            return x.new_zeros(*lead, self.out_features)
        g = self.group_size
        on_cuda = x.is_cuda
        if on_cuda and g is None and _has_fp8_tensor_cores(torch.cuda.current_device() if x.device.index is None
                                                           else x.device.index):
            from pdserve.kernels.fp8_quant_triton import quantize_e4m3_rows  # one kernel, padded for cuBLASLt
            xq, sx = quantize_e4m3_rows(x2 if x2.stride(-1) == 1 else x2.contiguous())
            return self._scaled_mm(xq, sx, x.dtype).reshape(*lead, self.out_features)
        xq, sx = quantize_e4m3(x2) if g is None else quantize_e4m3_groups(x2, g)
        if on_cuda:
            from pdserve.kernels.fp8_gemm_triton import fp8_gemm_triton  # Triton only where it can run
            sw = self.weight_scale if g is None else self.weight_scale.t()   # [N] or B's [Kg, Ng]
            y = fp8_gemm_triton(xq, sx, self.weight.t(), sw, out_dtype=x.dtype, bias=self.bias, group_size=g)
        else:
            y = self._cpu_mm(xq, sx, x.dtype)
        return y.reshape(*lead, self.out_features)

    def _epilogue(self, acc: torch.Tensor, sx: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """fp32 ``acc`` ``[M, N]`` -> ``acc * sx[:, None] * sw[None, :] (+ b)`` in ``dtype``;
        ``sx=None``: ``acc`` is already scaled (grouped numerics), only the bias is added."""
        y = acc if sx is None else acc * sx[:, None] * self.weight_scale[None, :]
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(dtype)

    def _cpu_operands(self) -> tuple[torch.Tensor, ...]:
        """Cached weight for the CPU path: per-channel ``(Wq values in dt,)``; grouped fp32
        ``(dequantized W [N, K] fp32,)``; grouped bf16 ``(Wq values bf16, sw per row [N, Kg])``."""
        w, dt, g = self.weight, self.cpu_matmul_dtype, self.group_size
        if self._cpu_weight is None or self._cpu_weight[0].device != w.device:
            if g is None:
                self._cpu_weight = (w.to(dt),)
            elif dt == torch.float32:
                self._cpu_weight = (dequantize_e4m3_blocks(w, self.weight_scale, g),)
            else:
                self._cpu_weight = (w.to(dt), self.weight_scale.repeat_interleave(g, dim=0)[:self.out_features])
        return self._cpu_weight

    def _cpu_mm(self, xq: torch.Tensor, sx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """CPU emulation: e4m3 values (exact in fp32/bf16) through a plain matmul; no speed-up."""
        dt, g, ops = self.cpu_matmul_dtype, self.group_size, self._cpu_operands()
        if g is None:
            return self._epilogue((xq.to(dt) @ ops[0].t()).float(), sx, dtype)
        if dt == torch.float32:
            return self._epilogue(dequantize_e4m3_groups(xq, sx, g) @ ops[0].t(), None, dtype)
        wv, sw_rows = ops
        xv, acc = xq.to(dt), None
        for j, k0 in enumerate(range(0, self.in_features, g)):
            part = (xv[:, k0:k0 + g] @ wv[:, k0:k0 + g].t()).float() * sx[:, j, None] * sw_rows[None, :, j]
            acc = part if acc is None else acc + part
        return self._epilogue(acc, None, dtype)

    def _scaled_mm(self, xq: torch.Tensor, sx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """cuBLASLt FP8 GEMM (per-channel only); N and K padded to multiples of 16 (its layout requirement).
        ``xq`` ``[M, K]`` or already ``[M, ceil(K/16)*16]`` (zero-padded); ``sx`` ``[M]`` fp32."""
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


def _keep_set(keep_high_precision: Iterable[str], num_layers: int) -> set[str]:
    """Normalize ``"mlp.down_proj"`` (every layer) / ``"1.mlp.down_proj"`` (layer 1) to ``{"<i>.<proj>"}``."""
    out = set()
    for name in keep_high_precision:
        head, _, rest = name.partition(".")
        if name in _PROJECTIONS:
            out |= {f"{i}.{name}" for i in range(num_layers)}
        elif head.isdigit() and int(head) < num_layers and rest in _PROJECTIONS:
            out.add(f"{int(head)}.{rest}")
        else:
            raise ValueError(f"keep_high_precision: {name!r} is not [<layer>.]<one of {_PROJECTIONS}>")
    return out


@torch.no_grad()
def convert_for_runtime(model: nn.Module, cpu_matmul_dtype: torch.dtype = torch.float32,
                        group_size: int | None = None, keep_high_precision: Iterable[str] = ()) -> None:
    """Swap every decoder layer's ``qkv_proj``, ``o_proj``, ``gate_up_proj`` and ``down_proj``
    for :class:`Fp8Linear`, in place (weights quantized now, on their current device).

    Args:
        model: a :class:`model.llama.LlamaForCausalLM` (anything with ``.layers``).
        cpu_matmul_dtype: see :class:`Fp8Linear` (CPU path only).
        group_size: None (default): per-token activation / per-output-channel weight scales;
            G (a positive multiple of 16): DeepSeek-V3 fine-grained scales, per-token ``1 x G``
            activation tiles and ``G x G`` weight blocks. The default stays per-channel because
            no G reaches the 97% top-1 target on TinyStories (see the module docstring).
        keep_high_precision: projections left as ``nn.Linear``: ``"mlp.down_proj"`` for every
            layer or ``"0.self_attn.qkv_proj"`` for one layer.

    ``lm_head`` and ``embed_tokens`` stay in high precision (the tied embedding is
    shared with the head, and logits are the most quantization-sensitive matmul).
    Already-converted layers are left alone (whatever their ``group_size``), so calling twice
    is harmless. On CPU the result is accurate FP8 numerics **without** any speed-up.
    """
    if group_size is not None:
        check_group_size(group_size)
    refuse_mixture(model, "FP8 activations (--activations fp8)")
    keep = _keep_set(keep_high_precision, len(model.layers))
    for i, layer in enumerate(model.layers):
        for path in _PROJECTIONS:
            if f"{i}.{path}" in keep:
                continue
            parent_name, attr = path.split(".")
            parent = getattr(layer, parent_name)
            mod = getattr(parent, attr)
            if isinstance(mod, nn.Linear):
                setattr(parent, attr, Fp8Linear.from_linear(mod, cpu_matmul_dtype, group_size))
