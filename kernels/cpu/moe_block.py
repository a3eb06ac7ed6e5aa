"""One mixture of experts in one C call (``moe_mlp.h: pd_moe_block``, in the decode_stack library), for the
steps that do not run in the decode stack: a prefill chunk's MLP, a decode worker's mixed or recomputed steps.

The per-operation path of :class:`model.moe.SparseMoeBlock` makes some 40 framework calls a layer (routing,
a gather, a GEMM, SiLU, a GEMM, a scale and an ``index_add_`` per expert). :class:`MoeBlock` runs the same
kernels in the same order in C, the decode stack's ``moe_mlp``: the router on its packed GEMM, the routing
(``pd_moe_route``), each expert's rows gathered, run through its packed gate_up, SiLU and down, and added
expert by expert in ascending order, rounded as ``index_add_`` rounds: bit-identical to the per-operation path
on the same packed weights (``tests/test_moe.py``).
"""

from __future__ import annotations

import ctypes

import torch

from pdserve.kernels.cpu import library
from pdserve.kernels.cpu.decode_stack import MoeSpec, StackStructs, _i64, _Kernels, _Model, _p, _symbol


class MoeBlock(StackStructs):
    """A mixture (router, experts, top-k) as the C kernels hold it, run by :meth:`__call__`.

    Args:
        spec: the router and every expert's projections on the packed C kernels (bf16 or INT4 VNNI).
        hidden: the model's hidden size.
        dtype: the activations' element type, float32 or bfloat16 (bf16-packed projections need bfloat16).
    Raises:
        ValueError: specs that do not fit each other or the kernels; another dtype.
        KernelUnavailable: a library it needs cannot be built here.
    """

    def __init__(self, spec: MoeSpec, hidden: int, dtype: torch.dtype) -> None:
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"MoeBlock: needs float32 or bf16 activations, got {dtype}")
        super().__init__(hidden, dtype, _Model(hidden=hidden, bf16=int(dtype == torch.bfloat16),
                                                k=_Kernels(silu_mul=_symbol("fused", "pd_silu_mul"))))
        self._moe = self._moe_struct(spec, "mixture")
        self._fn = library("decode_stack").pd_moe_block
        self._fn.argtypes, self._fn.restype = [_p, _p, _p, _p, _i64], ctypes.c_int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[n, hidden]`` contiguous, of the block's dtype, on the CPU -> the mixture's output, same shape.

        Raises:
            ValueError: another shape, dtype or layout.
            RuntimeError: AMX tiles were refused to this process.
            MemoryError: the scratch memory could not be allocated.
        """
        n = x.shape[0]
        if x.dtype != self.dtype or x.shape != (n, self.hidden) or not x.is_contiguous() or x.device.type != "cpu":
            raise ValueError(f"MoeBlock: x {tuple(x.shape)} {x.dtype} on {x.device} does not fit a contiguous "
                             f"[n, {self.hidden}] {self.dtype} CPU tensor")
        out = torch.empty_like(x)
        rc = self._fn(ctypes.byref(self._model), ctypes.byref(self._moe), x.data_ptr(), out.data_ptr(), n)
        if rc == -2:
            raise RuntimeError("MoeBlock: AMX tiles refused to this process")
        if rc:
            raise MemoryError("MoeBlock: the scratch memory could not be allocated")
        return out
