"""Sparse mixture-of-experts feed-forward blocks (Qwen3-MoE, Mixtral, Qwen2-MoE), as their ``transformers`` modeling
code computes them (``Qwen3MoeSparseMoeBlock``, ``MixtralSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock``; Shazeer et
al. 2017, Jiang et al. 2024)::

    logits = x @ gate^T                      [tokens, experts], in the model's dtype
    p = softmax(logits) in float32;  w, e = top-k(p)          (renormalized: w / sum(w), where the family does)
    y[t] = sum over the experts e of t, in ascending expert order, of  w[t, e] * expert_e(x[t])

Each expert is a SwiGLU :class:`~model.llama.MLP` of ``moe_intermediate_size``, run only on the tokens routed to
it, its output times the routing weight (rounded to the model's dtype first, or kept in float32: Mixtral's) added
into ``y`` expert by expert, as ``transformers`` adds them (``index_add_``): float32 outputs equal its to rounding.
The router and the experts' projections are ordinary linears, so the CPU path packs them for the C GEMM/GEMV
kernels as it packs the dense ones, and decode steps run a mixture inside the one-call C stack
(``moe_mlp.h: moe_mlp``, in the decode_stack library, :mod:`model.cpu_stack`), other steps on the C kernels
(prefill chunks) in one C call of it (:class:`kernels.cpu.moe_block.MoeBlock`), bit-identical to this module's
path on the same kernels;
Qwen2-MoE's shared expert (``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` added last) keeps its mixtures
on the per-operation path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pdserve.kernels.cpu import available
from pdserve.kernels.cpu.decode_stack import moe_route
from pdserve.model.config import ModelConfig
from pdserve.model.cpu_stack import moe_block


class SparseMoeBlock(nn.Module):
    """``num_experts`` SwiGLU experts behind a top-k softmax router (see the module docstring).

    ``expert``: the SwiGLU block class, called as ``expert(cfg, intermediate)`` (:class:`model.llama.MLP`).
    ``forward``: ``x`` ``[tokens, hidden]`` -> ``[tokens, hidden]`` in ``x``'s dtype; on the CPU, for a step of
    any size, in one C call where its router and experts are packed for the C kernels and ``c_block`` is on
    (routed as ``cpu_kernels`` routes), else operation by operation (:meth:`forward_per_op`).
    """

    c_block: bool = True

    def __init__(self, cfg: ModelConfig, expert: Callable[[ModelConfig, int], nn.Module]) -> None:
        super().__init__()
        self.top_k, self.renormalize, self.float_weights = (cfg.num_experts_per_tok, cfg.norm_topk_prob,
                                                            cfg.moe_weights_in_float)
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(expert(cfg, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        self.shared_expert = self.shared_expert_gate = None            # Qwen2-MoE's: every token runs it
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = expert(cfg, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor, cpu_kernels: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights, experts)``, each ``[tokens, top_k]``: the routing weights (float32 or ``x``'s dtype) and
        the experts' indices (int64), likeliest first. With ``cpu_kernels`` (decode steps on the C kernels) the
        decode stack's C routing (:func:`kernels.cpu.decode_stack.moe_route`), so that the one-call stack and
        this path pick the same experts with the same weights."""
        logits = self.gate(x)
        if cpu_kernels and self.top_k <= 64 and available("decode_stack") and logits.is_contiguous():
            weights, experts = moe_route(logits, self.top_k, self.renormalize,
                                         round_bf16=logits.dtype == torch.bfloat16 and not self.float_weights)
        else:
            weights, experts = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), self.top_k, dim=-1)
            if self.renormalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.float_weights else weights.to(logits.dtype)), experts

    def forward(self, x: torch.Tensor, cpu_kernels: bool = False) -> torch.Tensor:
        if self.c_block and x.device.type == "cpu" and x.dim() == 2 and x.is_contiguous():
            block = moe_block(self, x.dtype)
            if block is not None:
                try:
                    return block(x)           # the same kernels in the same order in one C call
                except MemoryError:           # its scratch (rows x experts' widths) could not be had: per operation
                    pass
        return self.forward_per_op(x, cpu_kernels)

    def forward_per_op(self, x: torch.Tensor, cpu_kernels: bool = False) -> torch.Tensor:
        """The mixture operation by operation: the routing, then each expert over its rows (module docstring)."""
        weights, experts = self.route(x, cpu_kernels)
        out = torch.zeros_like(x)
        for e in torch.unique(experts).tolist():           # ascending, as transformers adds them
            tokens, slot = torch.where(experts == e)
            y = self.experts[e](x[tokens], cpu_kernels) * weights[tokens, slot, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        if self.shared_expert is not None:       # transformers' order: the routed sum, then the gated shared one
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, cpu_kernels)
        return out


def mixture_module_names(model: nn.Module) -> tuple[str, ...]:
    """The names of the routers and experts' projections of ``model``'s mixtures that can run in one C call
    (:class:`kernels.cpu.moe_block.MoeBlock`: every mixture but one with a shared expert), for a loader that packs
    them for the C kernels where it gives the dense projections to another library (a prefill worker with AMX)."""
    return tuple(sub for name, module in model.named_modules()
                 if isinstance(module, SparseMoeBlock) and module.shared_expert is None
                 for sub in (f"{name}.gate", *(f"{name}.experts.{e}.{proj}" for e in range(len(module.experts))
                                               for proj in ("gate_up_proj", "down_proj"))))
