"""Group-wise asymmetric INT4 weight-only quantization (W4A16) for the decode worker.

Two phases, as in gpt-fast's ``quantize.py`` (``WeightOnlyInt4QuantHandler``):

* offline, :func:`~model.quant.int4_checkpoint.create_quantized_state_dict` /
  :func:`~model.quant.int4_checkpoint.save_quantized_checkpoint` write a pre-quantized
  checkpoint (settings as JSON in the safetensors header, key ``"pdserve_quantization"``);
* at run time, :func:`convert_for_runtime` swaps the decoder layers' ``qkv_proj``,
  ``o_proj``, ``gate_up_proj`` and ``down_proj`` ``nn.Linear`` for :class:`Int4Linear`
  quantized from their float weights, and
  :func:`~model.quant.int4_checkpoint.load_int4_checkpoint` builds the model from a
  pre-quantized checkpoint. Embeddings, norms and ``lm_head`` stay in float.

The tensor format, its rounding methods and the settings recorded in checkpoints are
:mod:`model.quant.int4_format`; GPTQ rounding is :mod:`model.quant.gptq`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.quant.gptq import gptq_quantize_model
from pdserve.model.quant.int4_format import (
    CALIBRATED,
    DEFAULT_METHOD,
    METHODS,
    TARGET_MODULES,
    check_group_size,
    dequantize_weight,
    padded_in_features,
    quantization_settings,
    quantize_weight,
    unpack_int4,
)

_CPU_N_ALIGN = 16  # _convert_weight_to_int4pack_for_cpu needs N % 16 == 0


class Int4Linear(nn.Module):
    """``nn.Linear`` with a group-wise INT4 weight: ``[..., in_features] -> [..., out_features]``.

    Buffers ``qweight`` / ``scales`` / ``zeros`` (module docstring) are the portable form that
    ``state_dict()`` holds; the kernels' own layout is built from them on first use per device
    (and after ``load_state_dict``), and kept besides them:

    * CPU, fewer than ``dequant_min_rows`` rows (decode): torch's tinygemm kernels,
      ``aten._convert_weight_to_int4pack_for_cpu`` (int32 ``[Np, Kp]``, ``Np`` = N rounded up to
      16 -> uint8 ``[Np, Kp // 2]`` blocked layout) and ``aten._weight_int4pack_mm_for_cpu(x [M, Kp]
      contiguous, packed, G, sz [Kp // G, Np, 2])`` with ``sz`` in the activation dtype. The op
      accepts fp32, fp16 and bf16 but only bf16 is fast (torch 2.13 CPU: fp32/fp16 are 10-40x
      slower than a dense fp32 matmul), so by default activations are cast to bf16 and the
      result back to ``x.dtype``; set ``exact_cpu = True`` to run the kernel in ``x.dtype``.
      Its cost grows ~linearly in M (~0.05 ms per row per 768x2048 weight, 1 thread), hence:
    * CPU, ``dequant_min_rows`` rows or more (prefill-sized): :func:`dequantize_weight` in fp32
      (~3.5-5 ms per 1.5M weights), cast to ``x.dtype``, then a dense ``F.linear``. The two paths
      cross over at ~100-130 rows for the 768x2048 + 2048x768 pair (measured, noisy machine).
    * CUDA: :func:`kernels.w4a16_triton.w4a16_matmul` on ``qweight.T`` (``[Kp // 2, N]``) and
      float32 ``sz [Kp // G, N, 2]``.

    Output dtype is ``x.dtype`` (float32, bfloat16 or float16; other dtypes run in float32).
    ``bias`` (``[N]``, float, or ``None``) is added in the output dtype.
    """

    exact_cpu: bool = False       # CPU kernel in x.dtype instead of bf16 (slow except for bf16)
    dequant_min_rows: int = 128   # CPU: from this many rows on, dequantize + dense matmul

    def __init__(self, in_features: int, out_features: int, bias: bool = False, group_size: int = 128,
                 device: torch.device | str | None = None, bias_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        check_group_size(group_size)
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        kp = padded_in_features(in_features, group_size)
        self.register_buffer("qweight", torch.empty(out_features, kp // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.empty(out_features, kp // group_size, device=device))
        self.register_buffer("zeros", torch.empty(out_features, kp // group_size, device=device))
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=bias_dtype, device=device), requires_grad=False)
                     if bias else None)
        self._rt_key: tuple | None = None
        self._rt: dict = {}

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 128, method: str = DEFAULT_METHOD,
                    quantized: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> "Int4Linear":
        """Quantize ``linear.weight`` (any float dtype) on its own device, or take ``quantized``
        ``(qweight, scales, zeros)`` made elsewhere (GPTQ); the bias is kept as is."""
        w = linear.weight
        mod = cls(linear.in_features, linear.out_features, linear.bias is not None, group_size, w.device,
                  linear.bias.dtype if linear.bias is not None else torch.float32)
        mod.qweight, mod.scales, mod.zeros = quantized or quantize_weight(w, group_size, method)
        if linear.bias is not None:
            mod.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return mod

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, group_size={self.group_size}")

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._rt_key = None                                      # buffers may have changed in place

    def prepare(self) -> None:
        """Build the kernel layout for the buffers' current device (done lazily by ``forward``)."""
        dev = self.qweight.device
        key = (dev, self.qweight.data_ptr(), self.scales.data_ptr(), self.zeros.data_ptr())
        if key == self._rt_key or dev.type == "meta":
            return
        if dev.type == "cuda":
            qweight_t, sz = self.triton_operands()
            self._rt = {"qweight_t": qweight_t, "sz": sz}
        else:
            sz = torch.stack([self.scales.float().t(), self.zeros.float().t()], dim=-1)  # [Gs, N, 2]
            pad = -self.out_features % _CPU_N_ALIGN                              # zero rows: q = 8, scale = zero = 0
            q = F.pad(unpack_int4(self.qweight).to(torch.int32), (0, 0, 0, pad), value=8)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 2)
            self._rt = {"packed": packed, "sz": F.pad(sz, (0, 0, 0, pad)).contiguous(), "sz_by_dtype": {}}
        self._rt_key = key

    def triton_operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(qweight_t uint8 [Kp // 2, N], sz float32 [Kp // G, N, 2])`` for :func:`w4a16_matmul`."""
        sz = torch.stack([self.scales.float().t(), self.zeros.float().t()], dim=-1)
        return self.qweight.t().contiguous(), sz.contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.prepare()
        lead, k = x.shape[:-1], x.shape[-1]
        if k != self.in_features:
            raise ValueError(f"Int4Linear: input has {k} features, expected {self.in_features}")
        out_dtype = x.dtype
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            x = x.float()
        x2 = x.reshape(-1, k)
        if x2.device.type == "cuda":
            from pdserve.kernels.w4a16_triton import w4a16_matmul  # triton only where it can run natively
            y = w4a16_matmul(x2, self._rt["qweight_t"], self._rt["sz"], self.group_size, self.bias)
        else:
            y = self._forward_cpu(x2)
        return y.reshape(*lead, self.out_features).to(out_dtype)

    def _forward_cpu(self, x2: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to(x2.dtype) if self.bias is not None else None
        if x2.shape[0] >= self.dequant_min_rows:
            w = dequantize_weight(self.qweight, self.scales, self.zeros, self.in_features).to(x2.dtype)
            return F.linear(x2, w, bias)
        xk = x2 if self.exact_cpu or x2.dtype == torch.bfloat16 else x2.to(torch.bfloat16)
        kp = self.qweight.shape[1] * 2
        if kp != self.in_features:
            xk = F.pad(xk, (0, kp - self.in_features))           # zero activations x padded columns
        sz_by_dtype = self._rt["sz_by_dtype"]
        sz = sz_by_dtype.get(xk.dtype)
        if sz is None:
            sz = sz_by_dtype[xk.dtype] = self._rt["sz"].to(xk.dtype)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xk.contiguous(), self._rt["packed"], self.group_size, sz)
        y = y[:, : self.out_features].to(x2.dtype)
        return y + bias if bias is not None else y


def iter_targets(model: nn.Module):
    """``(parent, attribute, module)`` of every quantized linear, in state-dict order."""
    for layer in model.layers:
        for path in TARGET_MODULES:
            owner, attr = path.split(".")
            parent = getattr(layer, owner)
            yield parent, attr, getattr(parent, attr)


def convert_for_runtime(model: nn.Module, group_size: int = 128, method: str = DEFAULT_METHOD) -> None:
    """Swap every decoder layer's ``qkv_proj``, ``o_proj``, ``gate_up_proj`` and ``down_proj``
    ``nn.Linear`` in place for :class:`Int4Linear` quantized from its float weight
    (load-time quantization of a bf16/fp32 checkpoint) and set ``model.quantization``
    to the settings dict. Modules that are already :class:`Int4Linear` are left alone.
    Same ``group_size`` and ``method`` give bit-identical tensors to a checkpoint written by
    :func:`~model.quant.int4_checkpoint.save_quantized_checkpoint`. Cost for bench-80m (1 thread):
    ~6 s with ``"mse"`` at group 128 (~12 s at 32), ~1.5 s with ``"rtn"``; ``"gptq"`` first samples
    calibration text from the model and runs it (:mod:`model.quant.gptq`).

    Raises:
        ValueError: unsupported group size or method.
    """
    check_group_size(group_size)
    if method not in METHODS:
        raise ValueError(f"int4: method must be one of {sorted(METHODS)}, got {method!r}")
    quantized = calibrated_weights(model, group_size, method)
    for parent, attr, mod in iter_targets(model):
        if isinstance(mod, nn.Linear):
            new = Int4Linear.from_linear(mod, group_size, method, quantized.get(mod))
            new.prepare()
            setattr(parent, attr, new)
    model.quantization = quantization_settings(group_size, method)


def calibrated_weights(model: nn.Module, group_size: int, method: str) -> dict[nn.Module, tuple]:
    """For a calibrated method, ``(qweight, scales, zeros)`` of each still-float target linear
    (keyed by the module); ``{}`` for the data-free methods."""
    if method not in CALIBRATED:
        return {}
    return gptq_quantize_model(model, [mod for _, _, mod in iter_targets(model) if type(mod) is nn.Linear],
                               group_size)


__all__ = ["Int4Linear", "calibrated_weights", "convert_for_runtime", "iter_targets"]
