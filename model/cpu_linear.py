"""bf16 linear layers for CPU decode over weights packed once for AVX512-BF16, AMX, and float32 FMAs.

A decode step multiplies a handful of rows by every weight, so its speed is the speed at
which weights stream from memory; from a few dozen rows on, the speed of the dot products.
The packed kernels (:mod:`kernels.cpu.gemv`) reach both limits where torch's bf16 ``F.linear``
does not. ms per bench-80m step of projections (151 MB of weights, huge pages), one thread, and
the share of the step's floor, max(FLOPs / 83.4 GFLOP/s, bytes / 12.9 GB/s), each reaches
(Xeon, Emerald Rapids, 2 KVM cores, no AMX; medians of thread CPU time):

    rows   AVX512-BF16 gemm    gemv            F.linear
    1       11.7  (100%)        14.6  (80%)      22.2  (53%)
    4       13.3   (88%)        18.6  (63%)      27.9  (42%)
    32      63.7   (91%)        71.8  (81%)      80.2  (72%)
    256    465.3   (99%)                        486.1  (95%)
    512    926.8  (100%)                        951.9  (97%)     (parity at 1024-2048 rows)
    on an AMX Xeon: gemv 10.5 at 1 row, AMX 13.7 at 32 rows (F.linear 21.5), 108.8 at 512 (89.3)

(``taskset -c 1 python bench/cpu_kernels.py``; docs/benchmarks.md). Chosen per row count
(:meth:`PackedBF16Linear.kernel_for`): the AVX512-BF16 gemm for every row count on a CPU without
AMX, but the gemv for up to four rows, which it takes in one pass over the weights (bit-identical; on
Zen 5 it streams 13% faster than the gemm at one row, 3.66 vs 4.20 ms, on Zen 4 10-20% faster at 1-4 rows,
where on the Xeon above the gemm won: that Xeon now runs the FMA gemm throughout), AMX
tiles for 3..512 rows where AMX-BF16 is granted, and ``F.linear`` beyond :data:`GEMM_MAX_ROWS` /
:data:`AMX_MAX_ROWS` rows where the dense weight is kept. A decode worker drops the dense weights
once packed (the packed kernels take any row count); a colocated one keeps them for its prefill
chunks. These kernels run on one thread: with more torch threads ``F.linear`` gains and they do not.
Each kernel's output row depends only on its input row; the gemv and the AVX512-BF16 gemm sum
in the same order (bit-identical), AMX in another, so on an AMX machine a request's bf16 logits
can differ in the last bit between a step of at most 2 rows and a larger one. On a CPU whose
``vdpbf16ps`` issues slowly (an Emerald Rapids core under KVM: a quarter of the FMA rate) the
float32-FMA gemm replaces the AVX512-BF16 one for every row count
(:func:`kernels.cpu.gemv.bf16_gemm_kernel`): 143 vs 87 GFLOP/s from 32 rows on, the same weight
stream at one row; so it does on an AVX-512 CPU without AVX512-BF16 (the same Xeon model under a
VM that hides AVX512-BF16 and AMX), where the alternative is ``F.linear``, and its 8-lane AVX2 form
(bit-identical) on a CPU without AVX-512 (AMD Zen 3 and older, client cores).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.cpu import fused
from pdserve.kernels.cpu.gemv import (
    AMX_SIDE_MIN_ROWS,
    KERNELS,
    amx_gate_up_silu,
    bf16_gemm_kernel,
    gemm_amx_available,
    pack_weight,
    packed_bf16_available,
    run_unchecked,
    unpack_weight,
)
from pdserve.model.linear_swap import TARGET_MODULES, swap_bf16_linears
from pdserve.model.onednn_linear import KERNEL as ONEDNN_KERNEL
from pdserve.model.onednn_linear import OneDNNGateUp, choose_gate_up_pieces, onednn_prepack_available, prepacked_copy

GEMV_MAX_ROWS = 4      # one weight pass for up to 4 rows: gemv vs AVX512-BF16 gemm per bench-80m step, Zen 4,
                       # 1-4 rows: 5.1 / 5.4 / 6.5 / 7.4 vs 6.3 / 6.9 / 7.3 / 8.2 ms, 5 rows 13.2 vs 7.5 (two
                       # passes); Zen 5: 3.66 vs 4.20 at 1 row (bench/cpu_kernels.py); where the FMA gemm
                       # serves, never (gemv_max_rows)
AMX_GEMV_MAX_ROWS = 2  # on an AMX Xeon: gemv 11.9 vs AMX 12.9 ms per bench-80m step at 2 rows; crossover 2-4
AMX_MAX_ROWS = 512     # with a dense (oneDNN prepacked) copy, whole bench-80m prefills of n rows, weights from memory,
                       # AMX Xeon 167, 2026-12-02, since the AMX gemm's plan from 128 rows (bench/packed_crossover.py):
                       # packed / oneDNN 0.73-0.75x at 16 rows, 0.84-0.86x at 128, 0.89-0.92x at 256, 1.00x at 512,
                       # 1.10x at 2,048 (before that plan 0.97-0.99x at 128 and 1.11-1.16x at 256: 128 then)
AMX_GATE_UP_PIECE_COLUMNS = 512  # widest piece of a gate_up on AMX tiles (amx_gate_up_silu): bench-80m's 512-token
                                 # prefill 87.6 against 88.7 ms with pieces of 1,024 (AMX Xeon 167, interleaved)
GEMM_MAX_ROWS = 512    # with a dense copy: AVX512-BF16 gemm 465 vs F.linear 486 ms at 256 rows, 927 vs 952 at 512
FLOAT_GEMMS = (KERNELS[3], KERNELS[4])
"""The packed GEMMs on float32 FMAs (``gemm-fma``, ``gemm-avx2``): on their CPUs ``F.linear`` in bf16 has no native
bf16 products either and ran 4-9x slower at every row count (a Xeon 207 without AVX512-BF16: 20% of the compute
floor at 512 rows against the FMA GEMM's 91%; Zen 3: 9.5 against 85 GFLOP/s at 2,048 rows), so beside them no
dense weight is kept and every row count runs packed."""


class PackedBF16Linear(nn.Module):
    """A bf16 ``nn.Linear`` whose products run on the packed weight.

    Input ``[..., in_features]`` bf16, output ``[..., out_features]`` bf16, float32 accumulation
    and one rounding (a bias is added after it: a second rounding, where ``F.linear`` has one).
    Args: ``linear`` (bf16, CPU); ``keep_dense``: also keep its dense weight (shared, not copied,
    when tied) for steps of more rows than the packed kernels serve best (:data:`AMX_MAX_ROWS`,
    :data:`GEMM_MAX_ROWS`), where oneDNN is faster (prefill chunks of a colocated worker): ``F.linear``
    on it, or, with ``prepack`` where :func:`model.onednn_linear.onednn_prepack_available`, oneDNN on a
    copy reordered once in its place (:class:`~model.onednn_linear.OneDNNLinear`, bit-identical to
    ``F.linear``; the dense weight is then not kept). ``gate_up``: the module is a SwiGLU MLP's gate_up,
    whose prepacked copy is then cut in pieces where :func:`model.onednn_linear.choose_gate_up_pieces` says so
    (:class:`~model.onednn_linear.OneDNNGateUp`), and ``silu_mul`` (set only then) runs the MLP's
    SiLU-and-mul piece by piece for those rows. Without ``keep_dense`` every row count runs on the packed
    weight, as on CPUs whose packed GEMM is one of :data:`FLOAT_GEMMS` (``keep_dense`` ignored). A float32 input
    goes through ``F.linear`` (on the dense weight, or one unpacked for the call).

    Raises:
        ValueError: ``linear``'s weight is not bf16 on the CPU.
    """

    def __init__(self, linear: nn.Linear, keep_dense: bool = True, prepack: bool = False,
                 gate_up: bool = False) -> None:
        super().__init__()
        if linear.weight.dtype != torch.bfloat16 or linear.weight.device.type != "cpu":
            raise ValueError(f"PackedBF16Linear needs a bf16 CPU weight, got {linear.weight.dtype} "
                             f"on {linear.weight.device}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.amx = gemm_amx_available() and self.in_features % 32 == 0
        if not self.amx and bf16_gemm_kernel() in FLOAT_GEMMS:
            keep_dense = False          # F.linear in bf16 is 4-9x slower than these at any row count: never taken
        self.onednn = prepacked_copy(linear, gate_up=gate_up) if keep_dense and prepack and \
            onednn_prepack_available() else None
        # a gate_up whose AMX products run in pieces, each piece's SiLU-and-mul beside the next one's tile work
        self.pieces = choose_gate_up_pieces(self.out_features // 2, 512, AMX_GATE_UP_PIECE_COLUMNS) \
            if gate_up and self.amx and linear.bias is None else 1
        if isinstance(self.onednn, OneDNNGateUp) or self.pieces > 1:
            self.silu_mul = self._silu_mul
        self.weight = linear.weight if keep_dense and self.onednn is None else None
        self.bias = linear.bias
        self.register_buffer("packed", pack_weight(linear.weight), persistent=False)
        # rows up to which the packed kernels run; beyond, oneDNN on the dense weight or its prepacked copy
        self.max_rows = None if not keep_dense else AMX_MAX_ROWS if self.amx else GEMM_MAX_ROWS

    def kernel_for(self, rows: int) -> str:
        """The kernel a bf16 input of ``rows`` rows runs on: ``"gemv-avx512bf16"``, ``"gemm-avx512bf16"``,
        ``"gemm-fma"``, ``"gemm-amx"``, ``"onednn-prepacked"`` (``"onednn-prepacked xN pieces"``) or ``"F.linear"``
        (recorded by the benchmarks next to their numbers)."""
        if self.max_rows is not None and rows > self.max_rows:
            return "F.linear" if self.onednn is None else self.onednn.kernel_for(rows)
        if rows <= gemv_max_rows(self.amx):
            return KERNELS[0]
        return KERNELS[2] if self.amx else bf16_gemm_kernel()

    def label_for(self, rows: int) -> str:
        """:meth:`kernel_for` as the benchmarks record it: an AMX gate_up's pieces named where its SiLU-and-mul runs
        beside them (:meth:`_silu_mul`)."""
        kernel = self.kernel_for(rows)
        if kernel == KERNELS[2] and self.pieces > 1 and rows >= AMX_SIDE_MIN_ROWS:
            return f"{kernel} x{self.pieces} pieces, SiLU beside"
        return kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        kernel = self.kernel_for(rows)
        if kernel.startswith(ONEDNN_KERNEL) and x.dtype == torch.bfloat16:
            return self.onednn(x)
        if x.dtype != torch.bfloat16 or kernel == "F.linear":
            dense = self.weight if self.weight is not None else unpack_weight(
                self.packed, self.out_features, self.in_features)
            return F.linear(x, dense.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        x2 = x.reshape(rows, self.in_features)
        if self.in_features % 2:
            x2 = F.pad(x2, (0, 1))
        elif x2.stride(1) != 1:
            x2 = x2.contiguous()
        y = run_unchecked(x2, self.packed, self.out_features, kernel)
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def _silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of this gate_up's output for ``x`` ``[rows, in_features]`` bf16 -> ``[rows, I]``: the
        prepacked pieces past :attr:`max_rows` rows; from :data:`~kernels.cpu.gemv.AMX_SIDE_MIN_ROWS` rows on AMX tiles
        in :attr:`pieces` pieces, each piece's SiLU-and-mul beside the next piece's tile work
        (:func:`kernels.cpu.gemv.amx_gate_up_silu`); else the packed kernels then the C SiLU-and-mul (bit-identical to
        the pieces)."""
        x2 = x.reshape(-1, self.in_features)
        if x.dtype == torch.bfloat16:
            if self.max_rows is not None and x2.shape[0] > self.max_rows and isinstance(self.onednn, OneDNNGateUp):
                return self.onednn.silu_mul(x)
            if self.pieces > 1 and x2.shape[0] >= AMX_SIDE_MIN_ROWS:
                return amx_gate_up_silu(x2.contiguous(), self.packed, self.out_features // 2, self.pieces).view(
                    *x.shape[:-1], -1)
        return fused.silu_and_mul(self(x).reshape(-1, self.out_features)).view(*x.shape[:-1], -1)


def gemv_max_rows(amx: bool) -> int:
    """Rows up to which the gemv serves a packed projection: :data:`AMX_GEMV_MAX_ROWS` where AMX tiles serve
    the rest, :data:`GEMV_MAX_ROWS` where the AVX512-BF16 gemm does (bit-identical to the gemv), 0 where the
    float32-FMA gemm does (:func:`kernels.cpu.gemv.bf16_gemm_kernel`): its summation order differs from the
    gemv's, and a row's result must not depend on how many rows share its step."""
    if amx:
        return AMX_GEMV_MAX_ROWS
    return GEMV_MAX_ROWS if bf16_gemm_kernel() == KERNELS[1] else 0


def dense_beats_packed_for_prefill(chunk_tokens: int = 512, threads: int = 1) -> bool:
    """Whether prefill chunks of up to ``chunk_tokens`` rows run faster on oneDNN's dense (prepacked) weights than
    on the packed ones here, for a worker of ``threads`` torch threads: on an AMX CPU for chunks of more than
    :data:`AMX_MAX_ROWS` rows (oneDNN 1.10x faster in a 2,048-row bench-80m prefill; the packed AMX gemm ties it
    at 512 rows and is ahead below, 0.75x at 16 rows, where it had lost at 512, 1.11x, before its plan from 128
    rows), and for a worker of more than one thread (the packed kernels run on one; oneDNN's on all). Without AMX
    the AVX512-BF16 gemm is at least as fast at every chunk size measured on one thread (Xeon model 207: 927 vs
    952 ms at 512 rows; Zen 5: ~520 vs ~505 GFLOP/s at 128 to 1,024 rows; `bench/cpu_kernels.py` measures
    both)."""
    return gemm_amx_available() and (chunk_tokens > AMX_MAX_ROWS or threads > 1)


def pack_for_cpu_decode(model: nn.Module, keep_dense: bool = False, names: tuple[str, ...] = TARGET_MODULES) -> int:
    """Swap the decoder layers' bf16 projections and the LM head for :class:`PackedBF16Linear` in place
    (a tied head gets a packed copy; the embedding keeps the dense weight). ``keep_dense``: see
    :class:`PackedBF16Linear` (a colocated worker keeps it for its prefill chunks). ``names``: the modules
    swapped, by the end of their names (:func:`model.linear_swap.swap_bf16_linears`).

    A no-op (returns 0) where no packed kernel can run (no compiler, no AVX-512; an AVX-512 CPU
    without AVX512-BF16 runs the float32-FMA gemm), for non-bf16 or non-CPU weights, and for already
    converted modules. Returns the number swapped.
    """
    if not packed_bf16_available():
        return 0
    # the LM head sees a few rows per step (those sampled): no prefill copy, and a tied one stays shared
    return swap_bf16_linears(model, lambda name, linear: PackedBF16Linear(
        linear, keep_dense, prepack=not name.endswith("lm_head"), gate_up=name.endswith("mlp.gate_up_proj")), names)
