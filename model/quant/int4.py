"""Group-wise asymmetric INT4 weight quantization for the decode worker (W4A16 on CUDA and
on CPUs without AVX512-VNNI; with it, activations are quantized to int8 per step: W4A8).

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

from pdserve.kernels.cpu.int4 import (
    AMX_KERNEL,
    int4_available,
    int4_path,
    pack_int4_weight,
    run_unchecked,
    unpack_int4_weight,
)
from pdserve.model.families import refuse_mixture
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
# kernel_for() names, recorded by benchmarks
VNNI, TORCH, DEQUANT, TRITON = "int4-vnni", "int4-torch", "int4-dequant-F.linear", "int4-triton"
TINYGEMM = "int4-tinygemm"
_VNNI_DTYPES = (torch.float32, torch.bfloat16)
_LAYOUT_BUFFERS = {VNNI: ("vnni_wq", "vnni_scales", "vnni_zc"), TORCH: ("tinygemm_packed", "tinygemm_sz"),
                   TRITON: ("triton_qweight_t", "triton_sz"),
                   TINYGEMM: ("triton_qweight_t", "triton_sz", "tinygemm_packed", "tinygemm_sz")}
TINYGEMM_MAX_ROWS = 8
"""CUDA: bf16 activations of at most this many rows (decode) run torch's tinygemm; more rows run Triton."""


def tinygemm_cuda_supported(device: torch.device, kp: int, out_features: int, group_size: int) -> bool:
    """Whether ``aten._weight_int4pack_mm`` (torch's tinygemm, CUDA sm80+) takes this weight: padded
    ``kp`` a multiple of 32, ``out_features`` of 8, a group of 32-256."""
    return (device.type == "cuda" and hasattr(torch.ops.aten, "_weight_int4pack_mm")
            and torch.cuda.get_device_capability(device) >= (8, 0) and kp % 32 == 0 and out_features % 8 == 0
            and group_size in (32, 64, 128, 256))


class Int4Linear(nn.Module):
    """``nn.Linear`` with a group-wise INT4 weight: ``[..., in_features] -> [..., out_features]``.

    Buffers ``qweight`` / ``scales`` / ``zeros`` (module docstring) are the portable form that
    ``state_dict()`` holds. :meth:`prepare` (at load; again, lazily, after ``load_state_dict`` or a
    move to another device type) builds one kernel layout from them into non-persistent buffers,
    which move with the module (``.to()``, :func:`model.hugepages.move_to_huge_pages`) and stay out
    of ``state_dict()``. :meth:`kernel_for` names the path a row count takes:

    * ``"int4-vnni"``, CPU with AVX512-VNNI, fewer than ``dequant_min_rows`` rows:
      :func:`kernels.cpu.int4.gemv_int4`, activations quantized per step to int8 per group of
      ``group_size`` (llama.cpp's Q8_0 scheme; int32-exact dot products), fp32 accumulation, output
      in the activation dtype (fp32 or bf16; fp16 runs in fp32). Streams the weight once per call.
      Accuracy cost of the int8 activations on TinyStories-656K (mse, G 128, 1280 positions): mean
      KL to the float model 0.0825 vs 0.0815 with exact activations, top-1 agreement 0.788 vs 0.780.
    * ``"int4-amx"``: the same layout, call and bits as ``"int4-vnni"``, from
      :data:`kernels.cpu.int4.AMX_MIN_ROWS` rows on a CPU with AMX-INT8 (the C library takes the
      integer dot products to tiles itself; :func:`kernels.cpu.int4.int4_path`).
    * ``"int4-torch"``, CPU without the C kernel (or ``exact_cpu = True``): torch's tinygemm,
      ``aten._weight_int4pack_mm_for_cpu`` over ``aten._convert_weight_to_int4pack_for_cpu``'s layout
      (N padded to 16) with ``sz [Kp // G, Np, 2]`` in the activation dtype. Only bf16 is fast there
      (torch 2.13 CPU: fp32/fp16 10-40x slower), so activations are cast to bf16 unless ``exact_cpu``.
    * ``"int4-dequant-F.linear"``, CPU, ``dequant_min_rows`` rows or more (prefill-sized):
      :func:`dequantize_weight` in fp32, cast to ``x.dtype``, then a dense ``F.linear``.
    * ``"int4-triton"``, CUDA: :func:`kernels.w4a16_triton.w4a16_matmul` on ``qweight.T``
      (``[Kp // 2, N]``) and float32 ``sz [Kp // G, N, 2]``.
    * ``"int4-tinygemm"``, CUDA sm80+ (:func:`tinygemm_cuda_supported`, ``cuda_tinygemm``): bf16 activations
      of at most :data:`TINYGEMM_MAX_ROWS` rows run torch's tinygemm (``aten._weight_int4pack_mm`` over
      ``_convert_weight_to_int4pack``'s layout, the kernel behind gpt-fast's and torchao's INT4 decode) with
      bf16 ``sz [Kp // G, N, 2]``; other rows run ``"int4-triton"``, whose layout it keeps beside its own.

    On CUDA ``qweight`` is then a transposed view of ``triton_qweight_t`` (contiguous again once the layout
    is dropped): 1 byte a weight for both layouts, not 1.5. On the CPU's ``"int4-vnni"`` layout (a
    permutation of the same nibbles) the ``qweight`` buffer is released once the layout is built, so
    the codes take half a byte a weight, not one; reading ``qweight`` (``state_dict()``, the dequantized
    path of long prefills, a move to another device) unpacks it from ``vnni_wq``, and dropping the
    layout restores the buffer.

    Output dtype is ``x.dtype`` (float32, bfloat16 or float16; other dtypes run in float32).
    ``bias`` (``[N]``, float, or ``None``) is added in the output dtype.
    """

    exact_cpu: bool = False       # CPU: torch's kernel in x.dtype (exact activations; slow except for bf16)
    cuda_tinygemm: bool = True    # CUDA: torch's tinygemm for decode rows where it runs (else Triton at every row)
    # CPU: from this many rows on, dequantize + dense bf16 matmul (1 thread, Xeon without AMX, the
    # 768x4096 + 2048x768 pair): VNNI 1.9 / 33 / 145 ms vs 62 / 170 / 508 ms at 64 / 1024 / 4096 rows,
    # so VNNI serves everything short of very long prefills (AMX CPUs may cross over sooner);
    # torch's kernel vs dequantize: ~100-130 rows.
    dequant_min_rows_vnni: int = 4096
    dequant_min_rows: int = 128

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
        self._layout: str | None = None                          # the kernel layout the buffers hold
        self._vnni: tuple | None = None                          # its buffers, for forward's fast path

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

    def _codes_released(self) -> bool:
        """Whether ``qweight`` lives only in the VNNI layout's ``vnni_wq`` (class docstring)."""
        return self.__dict__.get("_layout") == VNNI and "qweight" not in self._buffers

    def _unpacked_codes(self) -> torch.Tensor:
        """The portable ``qweight`` unpacked from ``vnni_wq`` (a new tensor; :meth:`_codes_released`)."""
        return unpack_int4_weight(self._buffers["vnni_wq"], self.out_features)

    def __getattr__(self, name: str):
        if name == "qweight" and self._codes_released():
            return self._unpacked_codes()
        return super().__getattr__(name)

    def _save_to_state_dict(self, destination, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._codes_released():
            destination[prefix + "qweight"] = self._unpacked_codes()

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        if self._codes_released():
            self._drop_layout()                                  # a buffer to load into
        super()._load_from_state_dict(*args, **kwargs)
        self._drop_layout()                                      # buffers may have changed in place

    def __setattr__(self, name: str, value) -> None:
        if name == "qweight" and "_buffers" in self.__dict__ and self._codes_released():
            self._drop_layout()                                  # so that the new codes become the buffer
        super().__setattr__(name, value)
        if name in ("qweight", "scales", "zeros") and self.__dict__.get("_layout") is not None:
            self._drop_layout()                                  # new portable tensors: rebuild from them

    def _apply(self, fn, recurse: bool = True):
        """``.to()``, ``.half()`` & co.: the layout buffers move along; a cast or a move to another
        device type makes them unusable, and they are rebuilt from the portable tensors on next use."""
        out = super()._apply(fn, recurse)
        if self._layout is not None:
            bufs = tuple(self._buffers[name] for name in _LAYOUT_BUFFERS[self._layout])
            if tuple(t.dtype for t in bufs) != self._layout_dtypes or self._wanted_layout() != self._layout:
                self._drop_layout()
            elif self._layout == VNNI:
                self._vnni = bufs                                # new tensor objects
            else:
                self._share_codes()                              # moved apart: one storage again
        return out

    def _wanted_layout(self) -> str:
        device = self.scales.device                             # qweight may be released (class docstring)
        if device.type == "cuda":
            kp = padded_in_features(self.in_features, self.group_size)
            ok = self.cuda_tinygemm and tinygemm_cuda_supported(device, kp, self.out_features, self.group_size)
            return TINYGEMM if ok else TRITON
        return VNNI if not self.exact_cpu and int4_available() else TORCH

    def _drop_layout(self) -> None:
        if self._codes_released():
            self._buffers["qweight"] = self._unpacked_codes()
        for name in _LAYOUT_BUFFERS.get(self._layout, ()):
            del self._buffers[name]
        self._layout, self._vnni = None, None
        if not self.qweight.is_contiguous():                    # it was a view of the Triton copy
            self._buffers["qweight"] = self.qweight.contiguous()

    def _share_codes(self) -> None:
        """CUDA: hold the portable ``qweight`` as a transposed view of the Triton layout's codes (the same
        bytes), so that a GPU keeps each INT4 weight twice (Triton's and tinygemm's layouts, 1 byte a
        weight) rather than three times. Set directly: ``__setattr__`` would drop the layout."""
        if self._layout in (TRITON, TINYGEMM) and self.qweight.data_ptr() != self.triton_qweight_t.data_ptr():
            self._buffers["qweight"] = self.triton_qweight_t.t()

    def prepare(self) -> None:
        """Build the kernel layout for the buffers' device type into non-persistent buffers, unless
        they hold it already (``forward`` calls this; loaders call it once at load)."""
        want = self._wanted_layout()
        if want == self._layout or self.scales.device.type == "meta":
            if want == VNNI:
                self._vnni = (self.vnni_wq, self.vnni_scales, self.vnni_zc)
            return
        self._drop_layout()
        if want == TRITON:
            tensors = self.triton_operands()
        elif want == TINYGEMM:
            tensors = (*self.triton_operands(), *self.tinygemm_cuda_operands())
        elif want == VNNI:
            tensors = pack_int4_weight(self.qweight, self.scales, self.zeros, self.group_size)
        else:
            sz = torch.stack([self.scales.float().t(), self.zeros.float().t()], dim=-1)  # [Gs, N, 2]
            pad = -self.out_features % _CPU_N_ALIGN                              # zero rows: q = 8, scale = zero = 0
            q = F.pad(unpack_int4(self.qweight).to(torch.int32), (0, 0, 0, pad), value=8)
            sz_dtype = torch.float32 if self.exact_cpu else torch.bfloat16        # the dtype it will run in
            tensors = (torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 2),
                       F.pad(sz, (0, 0, 0, pad)).to(sz_dtype).contiguous())
        for name, t in zip(_LAYOUT_BUFFERS[want], tensors):
            self.register_buffer(name, t, persistent=False)
        self._layout, self._layout_dtypes = want, tuple(t.dtype for t in tensors)
        if want == VNNI:        # the same tensor objects: move_to_huge_pages swaps their storage in place
            self._vnni = tuple(tensors)
            del self._buffers["qweight"]                        # held in vnni_wq (class docstring)
        self._share_codes()

    def kernel_for(self, rows: int) -> str:
        """The path ``forward`` takes for ``rows`` activation rows on the buffers' device:
        ``"int4-vnni"``, ``"int4-amx"``, ``"int4-torch"``, ``"int4-dequant-F.linear"`` or ``"int4-triton"``
        (class docstring)."""
        want = self._wanted_layout()
        if want == TINYGEMM:
            return TINYGEMM if rows <= TINYGEMM_MAX_ROWS else TRITON
        if want == TRITON:
            return TRITON
        if rows >= (self.dequant_min_rows_vnni if want == VNNI else self.dequant_min_rows):
            return DEQUANT
        return int4_path(rows) if want == VNNI else want

    def triton_operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(qweight_t uint8 [Kp // 2, N], sz float32 [Kp // G, N, 2])`` for :func:`w4a16_matmul`."""
        sz = torch.stack([self.scales.float().t(), self.zeros.float().t()], dim=-1)
        return self.qweight.t().contiguous(), sz.contiguous()

    def tinygemm_cuda_operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(packed, sz bf16 [Kp // G, N, 2])`` for ``aten._weight_int4pack_mm`` on CUDA: the codes two to a
        byte, even k in the high nibble (torchao's tensor-core tiled layout), tiled by
        ``aten._convert_weight_to_int4pack``; ``w = (q - 8) * scale + zero`` as on the CPU path."""
        q = unpack_int4(self.qweight).to(torch.int32)                            # [N, Kp] in 0..15
        kp = q.shape[1]
        inner_k_tiles = 8 if kp % 128 == 0 else 4 if kp % 64 == 0 else 2
        u8 = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8).contiguous()
        sz = torch.stack([self.scales.float().t(), self.zeros.float().t()], dim=-1)
        return (torch.ops.aten._convert_weight_to_int4pack(u8, inner_k_tiles),
                sz.to(torch.bfloat16).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        vnni, k = self._vnni, x.shape[-1]
        if vnni is not None and not self.exact_cpu and k == self.in_features and x.dtype in _VNNI_DTYPES and x.is_cpu:
            x2 = x.reshape(-1, k)                                # decode fast path: ~5 us of Python per call
            if x2.shape[0] < self.dequant_min_rows_vnni:
                if k > 1 and x2.stride(1) != 1:
                    x2 = x2.contiguous()
                y = run_unchecked(x2, *vnni, self.out_features, self.group_size, x2.dtype)
                if self.bias is not None:
                    y += self.bias
                return y.view(*x.shape[:-1], self.out_features)
        self.prepare()
        lead, k = x.shape[:-1], x.shape[-1]
        if k != self.in_features:
            raise ValueError(f"Int4Linear: input has {k} features, expected {self.in_features}")
        out_dtype = x.dtype
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            x = x.float()
        x2 = x.reshape(-1, k)
        if (self._layout == TINYGEMM and x2.is_cuda and x2.dtype == torch.bfloat16
                and x2.shape[0] <= TINYGEMM_MAX_ROWS):
            kp = self.qweight.shape[1] * 2
            xk = x2 if kp == k else F.pad(x2, (0, kp - k))                 # zero activations x padded columns
            y = torch.ops.aten._weight_int4pack_mm(xk.contiguous(), self.tinygemm_packed, self.group_size,
                                                   self.tinygemm_sz)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
        elif x2.device.type == "cuda":
            from pdserve.kernels.w4a16_triton import w4a16_matmul  # triton only where it can run natively
            y = w4a16_matmul(x2, self.triton_qweight_t, self.triton_sz, self.group_size, self.bias)
        else:
            y = self._forward_cpu(x2)
        return y.reshape(*lead, self.out_features).to(out_dtype)

    def _forward_cpu(self, x2: torch.Tensor) -> torch.Tensor:
        path = self.kernel_for(x2.shape[0])
        if path in (VNNI, AMX_KERNEL):
            xk = x2 if x2.dtype in (torch.float32, torch.bfloat16) else x2.float()
            if xk.shape[1] > 1 and xk.stride(1) != 1:
                xk = xk.contiguous()
            y = run_unchecked(xk, self.vnni_wq, self.vnni_scales, self.vnni_zc, self.out_features,
                              self.group_size, xk.dtype)
            if self.bias is not None:
                y += self.bias                                   # as forward's fast path
            return y
        bias = self.bias.to(x2.dtype) if self.bias is not None else None
        if path == DEQUANT:
            w = dequantize_weight(self.qweight, self.scales, self.zeros, self.in_features).to(x2.dtype)
            return F.linear(x2, w, bias)
        xk = x2 if self.exact_cpu or x2.dtype == torch.bfloat16 else x2.to(torch.bfloat16)
        kp = self.qweight.shape[1] * 2
        if kp != self.in_features:
            xk = F.pad(xk, (0, kp - self.in_features))           # zero activations x padded columns
        sz = self.tinygemm_sz if self.tinygemm_sz.dtype == xk.dtype else self.tinygemm_sz.to(xk.dtype)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xk.contiguous(), self.tinygemm_packed, self.group_size, sz)
        y = y[:, : self.out_features].to(x2.dtype)
        return y + bias if bias is not None else y


def iter_targets(model: nn.Module):
    """``(parent, attribute, module)`` of every quantized linear, layer by layer: the attention's projections,
    then the MLP's, or a mixture's experts' (every expert's ``gate_up_proj``, then every ``down_proj``; its
    router stays in float)."""
    for layer in model.layers:
        for path in TARGET_MODULES:
            owner, attr = path.split(".")
            parent = getattr(layer, owner)
            for holder in getattr(parent, "experts", None) or (parent,):
                yield holder, attr, getattr(holder, attr)


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
    refuse_mixture(model, f"INT4 {method} calibration (experts see only the tokens routed to them)")
    return gptq_quantize_model(model, [mod for _, _, mod in iter_targets(model) if type(mod) is nn.Linear],
                               group_size)


__all__ = ["Int4Linear", "calibrated_weights", "convert_for_runtime", "iter_targets"]
