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

Format (per output row ``n``, per group ``g`` of ``G = group_size`` input columns)::

    W[n, k] ~= (q[n, k] - 8) * scales[n, k // G] + zeros[n, k // G],   q in [0, 15]

i.e. asymmetric ``W ~= q * s + m`` (``m`` = group minimum) stored in the float-zero-point
convention of torch's tinygemm kernels (``zeros = m + 8 s``). ``in_features`` (K) that is not
a multiple of ``G`` is zero-padded to ``Kp = ceil(K / G) * G`` inside the quantized weight
(the padding is excluded from the group statistics); activations are zero-padded to ``Kp``
at run time on CPU and masked in the Triton kernel. Tensors of one module:

    qweight  uint8   [N, Kp // 2]  column 2j in the low nibble of byte j, 2j+1 in the high one
    scales   float32 [N, Kp // G]
    zeros    float32 [N, Kp // G]

Scale search (``method="mse"``, name ``int4-mse-asym``): per group, grid-search a shrunken
clipping range ``[c - a r, c + a r]`` (``c``, ``r`` the range's centre and half-width,
``a`` in [0.7, 1], 16 steps) for least squared weight error (the clipping search of AWQ, Lin
et al. 2024, with weight error in place of AWQ's activation-weighted output error), then 4
rounds of least-squares refits of ``(s, m)`` given ``q`` and re-rounding of ``q`` (as llama.cpp's
k-quants ``make_qkx`` do); no step may raise a group's squared error. On TinyStories-656K it
lowers the summed squared weight error by 13-15% vs ``method="rtn"`` (``int4-rtn-asym``,
plain min/max round-to-nearest, ``|W - W^| <= s / 2``). Data-free: no calibration set.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

METADATA_KEY = "pdserve_quantization"        # safetensors header key of the settings JSON
FORMAT_VERSION = 1
SUPPORTED_GROUP_SIZES = (32, 64, 128, 256)   # what torch's CPU int4 kernel accepts
METHODS = {"rtn": "int4-rtn-asym", "mse": "int4-mse-asym", "gptq": "int4-gptq-asym"}
CALIBRATED = ("gptq",)                       # methods that need the whole model (model.quant.gptq)
DEFAULT_METHOD = "mse"
TARGET_MODULES = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
_CLIP_GRID = torch.linspace(1.0, 0.7, 16).tolist()
_REFIT_ITERS = 4
_ROW_CHUNK = 64                              # rows quantized at a time
_CPU_N_ALIGN = 16                            # _convert_weight_to_int4pack_for_cpu needs N % 16 == 0


def padded_in_features(in_features: int, group_size: int) -> int:
    """``Kp``: ``in_features`` rounded up to whole groups."""
    return -(-in_features // group_size) * group_size


def _check_group_size(group_size: int) -> None:
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"int4: group_size must be one of {SUPPORTED_GROUP_SIZES}, got {group_size}")


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``[N, Kp]`` integers in [0, 15] (Kp even) -> ``[N, Kp // 2]`` uint8, even column in the low nibble."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``[N, Kp // 2]`` uint8 -> ``[N, Kp]`` uint8."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def _round_q(w: torch.Tensor, s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return torch.sub(w, m).div_(s).round_().clamp_(0, 15)       # q = clamp(round((w - m) / s), 0, 15)


def _minmax_params(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and offset mapping ``[lo, hi]`` onto the 16 levels; ``s`` is kept > 0 for flat groups."""
    s = ((hi - lo) / 15).clamp_min(torch.finfo(torch.float32).tiny * 16)
    return s, lo


def quantize_weight(weight: torch.Tensor, group_size: int = 128,
                    method: str = DEFAULT_METHOD) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize a linear layer's weight group-wise to asymmetric INT4.

    Args:
        weight: ``[N, K]`` (out_features, in_features), any float dtype; computed in float32.
        group_size: input columns per (scale, zero) pair, one of :data:`SUPPORTED_GROUP_SIZES`.
        method: ``"rtn"`` (min/max round-to-nearest) or ``"mse"`` (clip search + least-squares refit).
    Returns:
        ``(qweight uint8 [N, Kp // 2], scales float32 [N, Kp // G], zeros float32 [N, Kp // G])``
        in the format of the module docstring.
    Raises:
        ValueError: unsupported group size or method, or ``weight`` not 2-D.
    """
    _check_group_size(group_size)
    if method not in METHODS or method in CALIBRATED:
        raise ValueError(f"int4: method must be one of {sorted(set(METHODS) - set(CALIBRATED))} here, got "
                         f"{method!r} (GPTQ needs calibration: convert_for_runtime or create_quantized_state_dict)")
    if weight.dim() != 2:
        raise ValueError(f"int4: weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    kp = padded_in_features(k, group_size)
    valid = None if kp == k else (torch.arange(kp, device=weight.device) < k).view(1, -1, group_size).float()
    qs, ss, zs = [], [], []
    for r in range(0, n, _ROW_CHUNK):                            # row chunks: temporaries stay in cache
        w = F.pad(weight[r:r + _ROW_CHUNK].detach().float(), (0, kp - k)).view(-1, kp // group_size, group_size)
        q, s, m = _quantize_groups(w, valid, method)             # w: [rows, Gs, G]
        qs.append(pack_int4(q.view(-1, kp)))
        ss.append(s.view(-1, kp // group_size))
        zs.append((m + 8 * s).view(-1, kp // group_size))        # q*s + m == (q - 8)*s + (m + 8s)
    return torch.cat(qs), torch.cat(ss), torch.cat(zs)


def _quantize_groups(w, valid, method):
    """``w [R, Gs, G]`` (``valid``: ``[1, Gs, G]`` 1/0 mask of real columns, or None) -> ``(q, s, m)``."""
    if valid is None:
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    else:                                                        # padding excluded from the statistics
        lo = torch.where(valid > 0, w, torch.inf).amin(-1, keepdim=True)
        hi = torch.where(valid > 0, w, -torch.inf).amax(-1, keepdim=True)
    s, m = _minmax_params(lo, hi)
    if method == "mse":
        s, m = _clip_search(w, valid, lo, hi, s, m)
        s, m = _refit(w, valid, s, m)
    return _round_q(w, s, m), s, m                               # padding: q of 0.0, never read anyway


def _masked(x, valid):
    return x if valid is None else x.mul_(valid)


def _sq_err(w, valid, s, m):
    e = _round_q(w, s, m).mul_(s).add_(m).sub_(w)                # W^ - W
    return _masked(e.square_(), valid).sum(-1, keepdim=True)


def _clip_search(w, valid, lo, hi, s, m):
    """Per group, the range ``[c - a r, c + a r]`` over ``a`` in the grid with least squared error."""
    c, r = (hi + lo) / 2, (hi - lo) / 2
    best = _sq_err(w, valid, s, m)
    for a in _CLIP_GRID[1:]:
        s_a, m_a = _minmax_params(c - a * r, c + a * r)
        err = _sq_err(w, valid, s_a, m_a)
        better = err < best
        s, m, best = torch.where(better, s_a, s), torch.where(better, m_a, m), torch.where(better, err, best)
    return s, m


def _refit(w, valid, s, m):
    """Alternate: ``q`` given ``(s, m)``; ``(s, m)`` = least squares of ``w ~= q s + m`` given ``q``."""
    cnt = w.shape[-1] if valid is None else valid.sum(-1, keepdim=True)
    wm = _masked(w.clone(), valid).sum(-1, keepdim=True) / cnt
    best = _sq_err(w, valid, s, m)
    for _ in range(_REFIT_ITERS):
        q = _round_q(w, s, m)
        qm = _masked(q.clone(), valid).sum(-1, keepdim=True) / cnt
        dq = _masked(q.sub_(qm), valid)                          # centred q (0 on padding)
        var = (dq * dq).sum(-1, keepdim=True)
        s_new = (dq * (w - wm)).sum(-1, keepdim=True) / var.clamp_min(1e-30)
        m_new = wm - s_new * qm
        ok = (var > 0) & (s_new > 0)
        s_new, m_new = torch.where(ok, s_new, s), torch.where(ok, m_new, m)
        err = _sq_err(w, valid, s_new, m_new)
        better = err < best                                      # keep monotone under float rounding
        s, m, best = torch.where(better, s_new, s), torch.where(better, m_new, m), torch.minimum(err, best)
    return s, m


def dequantize_weight(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                      in_features: int) -> torch.Tensor:
    """``[N, K]`` float32 ``(q - 8) * scale + zero``: the reference every kernel is tested against
    (also the large-batch CPU path, so kept to in-place broadcast passes: ~3.5 ms per 1.5M weights)."""
    n, gs = scales.shape
    q = unpack_int4(qweight).view(n, gs, -1).float()
    q.sub_(8).mul_(scales.float()[..., None]).add_(zeros.float()[..., None])
    return q.view(n, -1)[:, :in_features]


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
        _check_group_size(group_size)
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
    _check_group_size(group_size)
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
    from pdserve.model.quant.gptq import gptq_quantize_model
    return gptq_quantize_model(model, [mod for _, _, mod in iter_targets(model) if type(mod) is nn.Linear],
                               group_size)


def quantization_settings(group_size: int, method: str) -> dict:
    """The settings recorded in a checkpoint's header (and on a converted model)."""
    return {"format_version": FORMAT_VERSION, "method": METHODS[method], "bits": 4, "group_size": group_size,
            "modules": list(TARGET_MODULES), "layout": "qweight uint8 [N, Kp/2] low nibble = even column; "
            "scales, zeros float32 [N, Kp/G]; W = (q - 8) * scale + zero; Kp = ceil(K/G)*G zero-padded"}


_OFFLINE = ("create_quantized_state_dict", "save_quantized_checkpoint", "load_int4_checkpoint",
            "is_int4_checkpoint", "read_quantization_metadata")


def __getattr__(name: str):
    """The offline half lives in :mod:`model.quant.int4_checkpoint` (which imports this module);
    its functions are re-exported here lazily so either module can be imported first."""
    if name in _OFFLINE:
        from pdserve.model.quant import int4_checkpoint
        return getattr(int4_checkpoint, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Int4Linear", "convert_for_runtime", "quantize_weight", "dequantize_weight", "pack_int4", "unpack_int4",
    "padded_in_features", "quantization_settings", "METADATA_KEY", "FORMAT_VERSION", "SUPPORTED_GROUP_SIZES",
    "TARGET_MODULES", *_OFFLINE,
]
