"""A decode step's decoder layers in one C call (``decode_stack.c``).

:class:`DecodeStack` holds a model's weights as the CPU kernels take them (packed bf16 or
INT4 projections, norm weights) in C structures built once, and :meth:`DecodeStack.run` runs
every layer and the final norm of a decode-sized step without returning to Python: the same
kernels in the same order as the per-operation path of :mod:`model.llama`, so the hidden
states are bit-identical to it. What is saved is the per-operation framework work (about
1 ms of a 4-5 ms INT4 step on a 12-layer model); :mod:`model.cpu_stack` builds the specs
from a model.

The C side keeps raw pointers: the stack keeps references to every tensor it points to, and
:meth:`DecodeStack.valid` says whether they still sit where they did (a move to huge pages or
a ``.to()`` replaces storages; the caller then builds a new stack).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from pdserve.kernels.cpu import available, library
from pdserve.kernels.cpu.gemv import SYMBOLS, bf16_gemm_kernel, gemm_amx_available, gemv_available
from pdserve.kernels.cpu.int4 import int4_library

_i64, _i32, _f, _p = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p
KERNEL = "decode-stack"       # the path name benchmarks record
_LIBRARIES = ("decode_stack", "fused", "paged_attention")


def stack_available(int4: bool = False, bf16_packed: bool = False) -> bool:
    """Whether :class:`DecodeStack` can run here with the kernels it would call (C compiler, ISA)."""
    libs = _LIBRARIES + ((int4_library(),) if int4 else ()) + ((SYMBOLS[bf16_gemm_kernel()][0],) if bf16_packed else ())
    return None not in libs and all(available(name) for name in libs)


@dataclass(frozen=True)
class LinearSpec:
    """One projection ``y [n, N] = x [n, K] W^T (+ bias)`` as a CPU kernel holds its weight.

    ``kind`` ``"bf16"``: ``weight`` packed bf16 ``[Np / 16, K / 2, 16, 2]`` (:func:`kernels.cpu.gemv.pack_weight`,
    ``K`` even), the gemv up to ``gemv_max_rows`` rows, then AMX tiles if ``amx`` else the CPU's bf16 gemm
    (:func:`kernels.cpu.gemv.bf16_gemm_kernel`).
    ``kind`` ``"int4"``: ``weight`` / ``scales`` / ``zc`` from :func:`kernels.cpu.int4.pack_int4_weight`
    with group ``group_size``. ``bias``: ``[N]`` float32 or bf16, or ``None``.
    """

    kind: str
    weight: torch.Tensor
    out_features: int
    in_features: int
    bias: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    zc: torch.Tensor | None = None
    group_size: int = 0
    gemv_max_rows: int = 0
    amx: bool = False


@dataclass(frozen=True)
class MoeSpec:
    """A mixture of experts in a layer's MLP's place (:class:`model.moe.SparseMoeBlock`): the ``router``
    ``[experts, hidden]``, each expert's ``gate_up`` ``[2 inter, hidden]`` and ``down`` ``[hidden, inter]``, the
    experts a token runs (``top_k``), whether their weights are renormalized and kept in float32."""

    router: LinearSpec
    gate_up: tuple[LinearSpec, ...]
    down: tuple[LinearSpec, ...]
    top_k: int
    renormalize: bool
    float_weights: bool
    inter: int


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: RMSNorm weights (``[hidden]``, and Qwen3's ``[head_dim]`` q/k norms or ``None``)
    of the element type, and its four projections; with ``moe``, a mixture of experts in place of the MLP
    (``gate_up`` and ``down`` then None)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: LinearSpec
    o: LinearSpec
    gate_up: LinearSpec | None
    down: LinearSpec | None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    moe: MoeSpec | None = None


def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool, round_bf16: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixture's routing in C (``pd_moe_route``, the decode stack's own): ``logits`` ``[n, experts]`` contiguous
    bf16 or float32 on the CPU -> ``(weights, experts)``, float32 and int64 ``[n, top_k]``: per row the softmax's
    ``top_k`` largest probabilities (ties: the lower expert first), renormalized to sum to 1 if ``renormalize``,
    rounded to bf16 values if ``round_bf16``.

    Raises:
        ValueError: another layout or dtype, or ``top_k`` outside ``[1, min(experts, 64)]``.
        KernelUnavailable: the library cannot be built here.
        MemoryError: the kernel's scratch memory could not be allocated.
    """
    n, experts = logits.shape
    if logits.dtype not in (torch.bfloat16, torch.float32) or not logits.is_contiguous() \
            or logits.device.type != "cpu" or not 0 < top_k <= min(experts, 64):
        raise ValueError(f"moe_route: needs contiguous bf16/float32 CPU logits and 1 <= top_k <= min(experts, 64), "
                         f"got {logits.dtype} {tuple(logits.shape)}, top_k {top_k}")
    weights, idx = torch.empty(n, top_k, dtype=torch.float32), torch.empty(n, top_k, dtype=torch.int32)
    fn = library("decode_stack").pd_moe_route
    fn.argtypes, fn.restype = [_p, _i64, _i64, _i64, ctypes.c_int, ctypes.c_int, ctypes.c_int, _p, _p], ctypes.c_int
    if fn(logits.data_ptr(), n, experts, top_k, int(renormalize), int(round_bf16),
          int(logits.dtype == torch.bfloat16), idx.data_ptr(), weights.data_ptr()):
        raise MemoryError("moe_route: its scratch memory could not be allocated")
    return weights, idx.long()


class _Linear(ctypes.Structure):
    _fields_ = [("kind", _i32), ("amx", _i32), ("bias_bf16", _i32), ("gemv_max_rows", _i32),
                ("w", _p), ("sc", _p), ("zc", _p),
                ("N", _i64), ("Np", _i64), ("K", _i64), ("Kp", _i64), ("G", _i64), ("bias", _p)]


class _Moe(ctypes.Structure):
    _fields_ = [("num_experts", _i32), ("top_k", _i32), ("renorm", _i32), ("float_weights", _i32), ("inter", _i64),
                ("router", _Linear), ("gate_up", ctypes.POINTER(_Linear)), ("down", ctypes.POINTER(_Linear))]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _p), ("post_norm", _p), ("q_norm", _p), ("k_norm", _p),
                ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
                ("moe", ctypes.POINTER(_Moe))]


class _Kernels(ctypes.Structure):
    _fields_ = [(name, _p) for name in ("gemv_bf16", "gemm_bf16", "gemm_amx", "gemm_int4", "rms_norm",
                                        "rope_write_kv", "attention", "silu_mul", "argmax_rows")]


class _Model(ctypes.Structure):
    _fields_ = [("hidden", _i64), ("H", _i64), ("Hkv", _i64), ("D", _i64), ("inter", _i64), ("num_layers", _i64),
                ("bf16", _i32), ("_pad", _i32), ("eps", _f), ("scale", _f), ("layers", ctypes.POINTER(_Layer)),
                ("final_norm", _p), ("k", _Kernels)]


class _Step(ctypes.Structure):
    _fields_ = [("cos_t", _p), ("sin_t", _p), ("cache", _p), ("s_layer_bytes", _i64), ("s_block", _i64),
                ("s_tok", _i64), ("s_head", _i64), ("s_v", _i64), ("block_size", _i64), ("slots", _p),
                ("qs", _p), ("seq_lens", _p), ("tables", _p), ("B", _i64), ("max_blocks", _i64)]


def _symbol(lib: str, name: str) -> int:
    return ctypes.cast(getattr(library(lib), name), _p).value


class StackStructs:
    """C descriptions (``Linear``, ``Moe`` and the kernels of ``Model`` in ``decode_stack.c``) of projections
    and mixtures, over tensors it keeps alive: what :class:`DecodeStack` and
    :class:`~kernels.cpu.moe_block.MoeBlock` build on.

    Args:
        hidden: the model's hidden size.
        dtype: the element type of activations, float32 or bfloat16.
        model: the C ``Model`` whose kernel table the projections described fill in.
    """

    def __init__(self, hidden: int, dtype: torch.dtype, model: _Model) -> None:
        self.hidden, self.dtype = hidden, dtype
        self._tensors: list[torch.Tensor] = []
        self._ptrs: list[int] = []             # their data pointers when described to the C side
        self._structs: list = []               # C arrays the structures point to (a mixture's)
        self._model = model

    @property
    def _who(self) -> str:
        return type(self).__name__            # names the class in error messages

    def _moe_struct(self, spec: MoeSpec, where: str) -> _Moe:
        """The C description of a mixture (kept alive by the stack, as its tensors are)."""
        experts = len(spec.gate_up)
        if not experts or len(spec.down) != experts or not 0 < spec.top_k <= min(experts, 64):
            raise ValueError(f"{self._who}: {where}: {experts} experts ({len(spec.down)} down projections), "
                             f"top {spec.top_k}: needs as many of each and 1 <= top_k <= min(experts, 64)")
        gate_up, down = (_Linear * experts)(), (_Linear * experts)()
        for e in range(experts):
            gate_up[e] = self.linear_struct(spec.gate_up[e], (2 * spec.inter, self.hidden), f"{where} expert {e}")
            down[e] = self.linear_struct(spec.down[e], (self.hidden, spec.inter), f"{where} expert {e}")
        moe = _Moe(num_experts=experts, top_k=spec.top_k, renorm=int(spec.renormalize),
                   float_weights=int(spec.float_weights), inter=spec.inter,
                   router=self.linear_struct(spec.router, (experts, self.hidden), f"{where} router"),
                   gate_up=gate_up, down=down)
        self._structs.extend((gate_up, down, moe))
        return moe

    def _resolve_kernels(self, kind: str) -> None:
        """The kernels of a projection ``kind``, resolved the first time one is described."""
        k = self._model.k
        if kind == "bf16" and not k.gemm_bf16:
            k.gemm_bf16 = _symbol(*SYMBOLS[bf16_gemm_kernel()])
            if gemv_available():                  # else no spec asks for them: gemv_max_rows 0, no AMX
                k.gemv_bf16 = _symbol("gemv_bf16", "pd_gemv_bf16")
            if gemm_amx_available():
                k.gemm_amx = _symbol("gemv_bf16", "pd_gemm_bf16_amx")
        elif kind == "int4" and not k.gemm_int4:
            k.gemm_int4 = _symbol(int4_library(), "pd_int4_gemv")

    def _keep(self, t: torch.Tensor) -> int:
        self._tensors.append(t)
        self._ptrs.append(t.data_ptr())
        return t.data_ptr()

    def _norm(self, w: torch.Tensor, dim: int) -> int:
        if w.dtype != self.dtype or w.shape != (dim,) or not w.is_contiguous() or w.device.type != "cpu":
            raise ValueError(f"{self._who}: a norm weight must be contiguous [{dim}] {self.dtype} on the CPU, "
                             f"got {tuple(w.shape)} {w.dtype}")
        return self._keep(w)

    def linear_struct(self, spec: LinearSpec, shape: tuple[int, int], where: str) -> _Linear:
        """The C description of projection ``spec`` of ``shape`` (out, in); the stack keeps its tensors alive
        (:class:`~kernels.cpu.decode_graph.DecodeGraph` describes the LM head so).

        Raises:
            ValueError: a weight, scales or bias that is not the kernels' layout of ``shape``, or a spec that
                asks for the gemv or AMX tiles where this CPU has neither.
        """
        n, k = shape
        if (spec.out_features, spec.in_features) != shape:
            raise ValueError(f"{self._who}: {where} is {spec.out_features} x {spec.in_features}, expected {n} x {k}")
        c = _Linear(N=n, K=k, gemv_max_rows=spec.gemv_max_rows, amx=int(spec.amx))
        w = spec.weight
        if spec.kind == "bf16":
            if w.dtype != torch.bfloat16 or w.dim() != 4 or w.shape[2:] != (16, 2) or not w.is_contiguous() \
                    or w.shape[1] * 2 != k or not w.shape[0] * 16 - 16 < n <= w.shape[0] * 16:
                raise ValueError(f"{self._who}: {where}: not a packed bf16 weight of {n} x {k} (K must be even)")
            if self.dtype != torch.bfloat16:
                raise ValueError(f"{self._who}: {where}: bf16-packed projections need bf16 activations")
            if (spec.gemv_max_rows > 0 and not gemv_available()) or (spec.amx and not gemm_amx_available()):
                raise ValueError(f"{self._who}: {where}: asks for the gemv or AMX tiles, which this CPU lacks")
            c.kind, c.Np, c.Kp = 0, w.shape[0] * 16, k
        elif spec.kind == "int4":
            g, kp = spec.group_size, w.shape[1] * 8
            if w.dtype != torch.uint8 or w.dim() != 4 or w.shape[2:] != (16, 4) or not w.is_contiguous() \
                    or not g or g % 16 or kp % g or k > kp or not w.shape[0] * 16 - 16 < n <= w.shape[0] * 16:
                raise ValueError(f"{self._who}: {where}: not a packed INT4 weight of {n} x {k}")
            for t in (spec.scales, spec.zc):
                if t is None or t.dtype != torch.float32 or t.shape != (w.shape[0], kp // g, 16) \
                        or not t.is_contiguous():
                    raise ValueError(f"{self._who}: {where}: INT4 scales and zc must be float32 "
                                     f"[{w.shape[0]}, {kp // g}, 16]")
            c.kind, c.Np, c.Kp, c.G = 1, w.shape[0] * 16, kp, g
            c.sc, c.zc = self._keep(spec.scales), self._keep(spec.zc)
        else:
            raise ValueError(f"{self._who}: {where}: unknown kind {spec.kind!r}")
        self._resolve_kernels(spec.kind)
        c.w = self._keep(w)
        if spec.bias is not None:
            if spec.bias.dtype not in (torch.float32, torch.bfloat16) or spec.bias.shape != (n,) \
                    or not spec.bias.is_contiguous():
                raise ValueError(f"{self._who}: {where}: bias must be contiguous [{n}] float32 or bf16")
            c.bias, c.bias_bf16 = self._keep(spec.bias), int(spec.bias.dtype == torch.bfloat16)
        return c

    @property
    def c_model(self):
        """A ctypes reference to the stack's C description (``Model`` in ``decode_stack.c``)."""
        return ctypes.byref(self._model)

    def valid(self) -> bool:
        """Whether every tensor the stack points to still has the storage it was built on (~60 ns a tensor)."""
        return list(map(torch.Tensor.data_ptr, self._tensors)) == self._ptrs


class DecodeStack(StackStructs):
    """Every decoder layer plus the final norm of one model, run by one C call per step.

    Args:
        layers: the layers, in order.
        final_norm: ``[hidden]`` weight of the last RMSNorm.
        num_heads, num_kv_heads, head_dim, intermediate_size: the shapes (``head_dim`` even, at most 512).
        eps: the RMSNorm epsilon (every norm of the model uses it).
        scale: the attention softmax scale.
        dtype: the element type of activations, norms and cache, float32 or bfloat16
            (bf16-packed projections need bfloat16).
    Raises:
        ValueError: specs that do not fit each other or the kernels.
        KernelUnavailable: a library it needs cannot be built here.
    """

    def __init__(self, layers: list[LayerSpec], final_norm: torch.Tensor, num_heads: int, num_kv_heads: int,
                 head_dim: int, intermediate_size: int, eps: float, scale: float, dtype: torch.dtype) -> None:
        if dtype not in (torch.float32, torch.bfloat16) or not layers:
            raise ValueError(f"DecodeStack: needs at least one layer and a float32/bf16 dtype, got {dtype}")
        if head_dim % 2 or head_dim > 512 or num_heads % num_kv_heads:
            raise ValueError(f"DecodeStack: head_dim {head_dim} / heads {num_heads}/{num_kv_heads} not supported")
        hidden = final_norm.shape[0]
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self._layers = (_Layer * len(layers))()
        super().__init__(hidden, dtype, _Model(
            hidden=hidden, H=num_heads, Hkv=num_kv_heads, D=head_dim, inter=intermediate_size,
            num_layers=len(layers), bf16=int(dtype == torch.bfloat16), eps=eps, scale=scale, layers=self._layers,
            k=_Kernels(rms_norm=_symbol("fused", "pd_rms_norm"), rope_write_kv=_symbol("fused", "pd_rope_write_kv"),
                       silu_mul=_symbol("fused", "pd_silu_mul"), argmax_rows=_symbol("fused", "pd_argmax_rows"),
                       attention=_symbol("paged_attention", "pd_paged_attention"))))
        self._model.final_norm = self._norm(final_norm, self.hidden)
        qkv_width = (num_heads + 2 * num_kv_heads) * head_dim
        shapes = {"qkv": (qkv_width, self.hidden), "o": (self.hidden, num_heads * head_dim),
                  "gate_up": (2 * intermediate_size, self.hidden), "down": (self.hidden, intermediate_size)}
        for i, spec in enumerate(layers):
            c = self._layers[i]
            c.input_norm = self._norm(spec.input_norm, self.hidden)
            c.post_norm = self._norm(spec.post_norm, self.hidden)
            if (spec.q_norm is None) != (spec.k_norm is None):
                raise ValueError("DecodeStack: q_norm and k_norm must both be given or both be None")
            c.q_norm = self._norm(spec.q_norm, head_dim) if spec.q_norm is not None else None
            c.k_norm = self._norm(spec.k_norm, head_dim) if spec.k_norm is not None else None
            for name, shape in shapes.items():
                if spec.moe is None or name in ("qkv", "o"):
                    setattr(c, name, self.linear_struct(getattr(spec, name), shape, f"layer {i} {name}"))
            if spec.moe is not None:
                c.moe = ctypes.pointer(self._moe_struct(spec.moe, f"layer {i}"))
        self.num_layers = len(layers)
        self._fn = library("decode_stack").pd_decode_stack
        self._fn.argtypes, self._fn.restype = [_p, _p, _p, _p, _i64, _i64], ctypes.c_int

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
            slot_mapping: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
            block_tables: torch.Tensor, num_layers: int | None = None) -> torch.Tensor:
        """Layers ``[0, num_layers)`` (default all) and the final norm over ``x``.

        Args:
            x: ``[n, hidden]`` contiguous, of the stack's dtype: the embedded tokens. Updated in place
                (it ends as the residual stream after the last layer run).
            cos, sin: ``[n, head_dim]`` (or ``[n, 1, head_dim]``) float32 rotary tables of the tokens' positions.
            kv_cache: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` contiguous, of
                the stack's dtype; each layer's new K/V are written at ``slot_mapping`` (``[n]`` int64).
            query_start_loc, seq_lens, block_tables: int32 ``[B + 1]``, ``[B]``, ``[B, max_blocks]`` contiguous,
                as :func:`kernels.cpu.attention.paged_attention_cpu` takes them.
        Returns:
            ``[n, hidden]`` of the stack's dtype: the final RMSNorm of the residual stream.
        Contract (not checked, as in the per-operation path): slots and block ids lie inside the cache.
        Raises:
            ValueError: shapes, dtypes or layouts that do not fit the stack.
            MemoryError: a kernel's scratch memory could not be allocated.
            RuntimeError: AMX tiles were refused to this process.
        """
        n = x.shape[0]
        layers = self.num_layers if num_layers is None else num_layers
        if x.dtype != self.dtype or x.shape != (n, self.hidden) or not x.is_contiguous() or not 0 < layers <= \
                self.num_layers or kv_cache.dtype != self.dtype or not kv_cache.is_contiguous() \
                or kv_cache.shape[1] < self.num_layers or kv_cache.shape[4:] != (self.num_kv_heads, self.head_dim):
            raise ValueError(f"DecodeStack.run: x {tuple(x.shape)} {x.dtype} or cache {tuple(kv_cache.shape)} "
                             f"{kv_cache.dtype} does not fit the stack, or num_layers {num_layers} is out of range")
        cos, sin = cos.reshape(n, self.head_dim), sin.reshape(n, self.head_dim)
        ints = (query_start_loc, seq_lens, block_tables)
        if any(t.dtype != torch.float32 or not t.is_contiguous() for t in (cos, sin)) \
                or slot_mapping.dtype != torch.int64 or slot_mapping.shape != (n,) or not slot_mapping.is_contiguous() \
                or any(t.dtype != torch.int32 or not t.is_contiguous() for t in ints):
            raise ValueError("DecodeStack.run: cos/sin must be contiguous float32, slot_mapping [n] int64, "
                             "query_start_loc/seq_lens/block_tables contiguous int32")
        s_block, s_layer, s_kv, s_tok, s_head, _ = kv_cache.stride()
        step = _Step(cos_t=cos.data_ptr(), sin_t=sin.data_ptr(), cache=kv_cache.data_ptr(),
                     s_layer_bytes=s_layer * kv_cache.element_size(), s_block=s_block, s_tok=s_tok, s_head=s_head,
                     s_v=s_kv, block_size=kv_cache.shape[3], slots=slot_mapping.data_ptr(),
                     qs=query_start_loc.data_ptr(), seq_lens=seq_lens.data_ptr(), tables=block_tables.data_ptr(),
                     B=seq_lens.shape[0], max_blocks=block_tables.shape[1])
        out = torch.empty_like(x)
        rc = self._fn(ctypes.byref(self._model), ctypes.byref(step), x.data_ptr(), out.data_ptr(), n, layers)
        if rc:
            self.raise_for(rc)
        return out

    @staticmethod
    def raise_for(rc: int) -> None:
        """Raises the error of a non-zero status of ``pd_decode_stack`` (-1: the stack's scratch; else
        1000 (layer + 1) + the failing kernel's code, -2 being AMX refused).

        Raises:
            RuntimeError: AMX tiles were refused to this process.
            MemoryError: otherwise (scratch memory could not be allocated).
        """
        layer, code = (rc // 1000, rc % 1000 - 1000) if rc > 0 else (0, rc)
        if code == -2:
            raise RuntimeError(f"DecodeStack: AMX tiles refused to this process (layer {layer})")
        raise MemoryError(f"DecodeStack: a kernel's scratch memory could not be allocated (layer {layer})")
