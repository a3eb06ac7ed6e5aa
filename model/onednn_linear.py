"""bf16 projections of prefill chunks through oneDNN on a weight reordered once, as torch.compile's freezing pass
(inductor's mkldnn weight prepacking) does for CPU linear layers.

``F.linear`` on a bf16 CPU weight hands oneDNN the plain ``[N, K]`` weight at every call, and oneDNN reorders it
into its blocked layout each time: one more pass over the weight per projection. Reordered once at load
(``torch.ops.mkldnn._reorder_linear_weight``) and multiplied by ``torch.ops.mkldnn._linear_pointwise``, the same
oneDNN primitive runs without it, bit-identical to ``F.linear`` at every row count. bench-80m's projections
at 512 rows on the AMX Xeon (family 6, model 167), one core, ms per call: qkv 0.84 -> 0.63, o_proj 0.46 -> 0.38,
down_proj 1.64 -> 1.20, gate_up 2.66 -> 2.69 (``bench/limits.py`` measures both as ``f_linear`` and
``onednn_prepacked``). A prefill worker takes it where oneDNN beats the packed kernels at its chunks
(:func:`model.cpu_linear.dense_beats_packed_for_prefill`: AMX CPUs, chunks over 512 rows), and a colocated decode
worker wherever this prepacking runs, for the prefill chunks' rows beyond its packed kernels
(:class:`model.cpu_linear.PackedBF16Linear`'s ``prepack``; on Zen 5 2-5% ahead of ``F.linear`` on bench-80m's
four shapes at 512 and 2,048 rows, ``docs/results/prefill_zen5_1128.json``).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from pdserve.kernels.cpu import fused
from pdserve.model.linear_swap import LAYER_MODULES, TARGET_MODULES, swap_bf16_linears

KERNEL = "onednn-prepacked"


@functools.cache
def onednn_prepack_available() -> bool:
    """Whether torch's oneDNN weight prepacking runs here for bf16 (its ops exist and oneDNN takes bf16 on this
    CPU: AVX-512 and newer)."""
    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise") and ops._is_mkldnn_bf16_supported()):
        return False
    try:
        w = torch.ones(16, 32, dtype=torch.bfloat16)
        y = ops._linear_pointwise(torch.ones(2, 32, dtype=torch.bfloat16), ops._reorder_linear_weight(w, 2),
                                  None, "none", [], "")
    except RuntimeError:
        return False
    return bool((y == 32).all())


class OneDNNLinear(nn.Module):
    """A bf16 ``nn.Linear`` whose weight is held in oneDNN's blocked layout, reordered once for steps of about
    ``rows_hint`` rows (any row count runs, bit-identical to ``F.linear``).

    Input ``[..., in_features]`` bf16 CPU; output ``[..., out_features]`` bf16. The dense weight is not kept
    (the packed one is an opaque oneDNN tensor, outside ``parameters()``); the bias is.

    Raises:
        ValueError: at construction, a weight that is not bf16 on the CPU; at a call, an input that is not.
    """

    def __init__(self, linear: nn.Linear, rows_hint: int = 512) -> None:
        super().__init__()
        if linear.weight.dtype != torch.bfloat16 or linear.weight.device.type != "cpu":
            raise ValueError(f"OneDNNLinear needs a bf16 CPU weight, got {linear.weight.dtype} on "
                             f"{linear.weight.device}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows_hint)

    def kernel_for(self, rows: int) -> str:
        """The kernel every row count runs on (recorded by the benchmarks next to their numbers)."""
        return KERNEL

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.device.type != "cpu":
            raise ValueError(f"OneDNNLinear takes bf16 CPU inputs, got {x.dtype} on {x.device}")
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def gate_up_piece(t: torch.Tensor, p: int, pieces: int) -> torch.Tensor:
    """Piece ``p`` of ``pieces`` of a gate_up weight ``[2 I, H]`` or bias ``[2 I]`` (gate rows first): the gate
    rows of intermediate columns ``[p I / pieces, (p + 1) I / pieces)`` followed by the same up rows."""
    inter = t.shape[0] // 2
    c = inter // pieces
    return torch.cat([t[p * c:(p + 1) * c], t[inter + p * c:inter + (p + 1) * c]])


def prepacked_copy(linear: nn.Linear, rows_hint: int = 512, gate_up: bool = False) -> nn.Module:
    """oneDNN's reordered copy of a bf16 ``linear``: :class:`OneDNNGateUp` for a SwiGLU MLP's gate_up
    (``gate_up``) where :func:`choose_gate_up_pieces` splits it and the C SiLU-and-mul runs vectorized, else
    :class:`OneDNNLinear`. Raises as they do."""
    pieces = choose_gate_up_pieces(linear.out_features // 2, rows_hint) if gate_up and fused.vectorized() else 1
    return OneDNNGateUp(linear, rows_hint, pieces) if pieces > 1 else OneDNNLinear(linear, rows_hint)


class OneDNNGateUp(nn.Module):
    """A SwiGLU MLP's fused ``gate_up_proj`` (weight ``[2 I, H]``, gate rows first) held as ``pieces`` oneDNN
    weights, piece ``p`` the gate and up rows of intermediate columns ``[p I / pieces, (p + 1) I / pieces)``,
    so that :meth:`silu_mul` runs each piece's projection and then its SiLU-and-mul while the piece's output is
    in L2, into its columns of the ``[rows, I]`` activation. ``forward`` gives the whole ``[rows, 2 I]``
    projection, as ``F.linear`` does up to oneDNN's summation order for the piece's width.

    Why: oneDNN's AMX kernel over the whole ``[4,096, 768]`` weight of bench-80m (6 MiB, three times the L2) at
    512 rows ran 3.05-3.15 ms a layer with each layer's weight read from memory, in four pieces 2.48-2.58
    (AMX Xeon model 167, one core; ``bench/prefill.py`` has the whole prefill). The piece count is chosen per
    model by :func:`choose_gate_up_pieces`.

    Raises:
        ValueError: at construction, a weight that is not bf16 on the CPU, of odd height or whose intermediate
        size ``pieces`` does not divide; at a call, an input that is not bf16 on the CPU.
    """

    def __init__(self, linear: nn.Linear, rows_hint: int = 512, pieces: int = 1) -> None:
        super().__init__()
        w = linear.weight.detach()
        if w.dtype != torch.bfloat16 or w.device.type != "cpu" or w.shape[0] % (2 * pieces):
            raise ValueError(f"OneDNNGateUp needs a bf16 CPU weight of height divisible by {2 * pieces}, got "
                             f"{w.dtype} {tuple(w.shape)} on {w.device}")
        self.in_features, self.out_features, self.pieces = linear.in_features, linear.out_features, pieces
        self.intermediate = w.shape[0] // 2
        self.bias = linear.bias
        self.packed = [torch.ops.mkldnn._reorder_linear_weight(gate_up_piece(w, p, pieces), rows_hint)
                       for p in range(pieces)]
        self.piece_bias = [None if linear.bias is None else gate_up_piece(linear.bias.detach(), p, pieces)
                           for p in range(pieces)]

    def kernel_for(self, rows: int) -> str:
        """The kernel every row count runs on (recorded by the benchmarks next to their numbers)."""
        return KERNEL if self.pieces == 1 else f"{KERNEL} x{self.pieces} pieces"

    def _piece(self, x: torch.Tensor, p: int) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.device.type != "cpu":
            raise ValueError(f"OneDNNGateUp takes bf16 CPU inputs, got {x.dtype} on {x.device}")
        return torch.ops.mkldnn._linear_pointwise(x, self.packed[p], self.piece_bias[p], "none", [], "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` -> ``[..., 2 I]`` (gate, then up)."""
        outs = [self._piece(x, p) for p in range(self.pieces)]
        c = self.intermediate // self.pieces
        return torch.cat([o[..., :c] for o in outs] + [o[..., c:] for o in outs], -1)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``x`` ``[rows, H]`` bf16 -> ``[rows, I]`` bf16, piece by piece
        (:func:`kernels.cpu.fused.silu_and_mul` into each piece's columns)."""
        x2 = x.reshape(-1, self.in_features)
        out = torch.empty(x2.shape[0], self.intermediate, dtype=torch.bfloat16)
        c = self.intermediate // self.pieces
        for p in range(self.pieces):
            fused.silu_and_mul(self._piece(x2, p), out[:, p * c:(p + 1) * c])
        return out.view(*x.shape[:-1], self.intermediate)


GATE_UP_PIECE_COLUMNS = 1536      # widest piece of a gate_up projection (gate and up columns together)
GATE_UP_PIECE_MIN_ROWS = 512      # chunks of fewer rows keep the whole weight


def choose_gate_up_pieces(intermediate: int, rows_hint: int, max_columns: int = GATE_UP_PIECE_COLUMNS) -> int:
    """Pieces of a gate_up projection with ``intermediate`` columns each of gate and up, for chunks of about
    ``rows_hint`` rows: the fewest (a power of two) whose pieces are at most ``max_columns`` (oneDNN's:
    :data:`GATE_UP_PIECE_COLUMNS`) wide, each piece's intermediate columns a multiple of 16; 1 (the whole weight)
    for chunks under :data:`GATE_UP_PIECE_MIN_ROWS` rows or where no such split exists.

    Measured with oneDNN's AMX matmul (``brg_matmul:avx10_1_512_amx``, AMX Xeon model 167, one core), each
    layer's weight read from memory as in a model, ms a layer for the gate_up projection alone:

    ============================  ======  ===================================================
    hidden x intermediate, rows    whole  pieces (width)
    ============================  ======  ===================================================
    768 x 2,048, 512 rows          3.13   2 (2,048): 2.94, **4 (1,024): 2.44**, 8 (512): 2.89
    768 x 2,048, 2,048 rows       14.37   2: 10.12, **4: 9.01**, 8: 9.33, 16: 10.16
    768 x 2,048, 256 rows          1.27   **whole**; 2: 1.35, 4: 1.32, 8: 1.40
    1,024 x 3,072, 512 rows        5.96   2 (3,072): 4.84, **4 (1,536): 4.80**, 8 (768): 4.94
    2,048 x 5,632, 512 rows       21.29   2: 20.86, 4 (2,816): 19.64, **8 (1,408): 19.74**, 16: 21.06
    ============================  ======  ===================================================

    (``taskset -c 1 .venv/bin/python bench/gate_up_pieces.py --hidden 768 --intermediate 2048 --rows 512``;
    whole prefills with the rule applied: ``bench/prefill.py``.)"""
    if rows_hint < GATE_UP_PIECE_MIN_ROWS:
        return 1
    pieces = 1
    while 2 * intermediate // pieces > max_columns:
        pieces *= 2
        if intermediate % pieces or (intermediate // pieces) % 16:
            return 1
    return pieces


def prepack_for_cpu_prefill(model: nn.Module, rows_hint: int = 512) -> int:
    """Swap the decoder layers' bf16 ``nn.Linear`` projections, and an untied LM head, for :class:`OneDNNLinear`
    in place; a dense SwiGLU MLP's gate_up for :class:`OneDNNGateUp` where :func:`choose_gate_up_pieces` splits
    it (and the C SiLU-and-mul runs vectorized). A head tied to the embedding stays as it is: a packed copy
    would add vocab x hidden bytes to speed up one row per prefill chunk (the last token's; bench-80m's head on
    that row: 0.28 ms prepacked, 0.50 with ``F.linear``). A no-op (returns 0) where
    :func:`onednn_prepack_available` is false; modules already converted or of another dtype or device stay.
    Returns the number swapped."""
    if not onednn_prepack_available():
        return 0
    head, embed = getattr(model, "lm_head", None), getattr(model, "embed_tokens", None)
    tied = head is not None and embed is not None and head.weight is embed.weight
    return swap_bf16_linears(model, lambda name, linear: prepacked_copy(linear, rows_hint,
                                                                       gate_up=name.endswith("mlp.gate_up_proj")),
                             LAYER_MODULES if tied else TARGET_MODULES)
