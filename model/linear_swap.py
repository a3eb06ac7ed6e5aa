"""Swapping a model's bf16 projections for the CPU linear modules (:mod:`model.cpu_linear`,
:mod:`model.onednn_linear`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# the decoder layers' projections, a mixture's experts' (mlp.experts.E.gate_up_proj) and router (mlp.gate) too
LAYER_MODULES = ("self_attn.qkv_proj", "self_attn.o_proj", "gate_up_proj", "down_proj", "mlp.gate")
TARGET_MODULES = (*LAYER_MODULES, "lm_head")


def swap_bf16_linears(model: nn.Module, convert: Callable[[str, nn.Linear], nn.Module],
                      names: tuple[str, ...] = TARGET_MODULES) -> int:
    """Replace each bf16 CPU ``nn.Linear`` whose name ends with one of ``names`` (by default the decoder layers'
    projections and the LM head, :data:`TARGET_MODULES`) with ``convert(name, linear)``, in place; other
    modules, dtypes and devices stay. Returns the number replaced."""
    swapped = 0
    for name, module in list(model.named_modules()):
        if not name.endswith(names) or type(module) is not nn.Linear:
            continue
        if module.weight.dtype != torch.bfloat16 or module.weight.device.type != "cpu":
            continue
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, convert(name, module))
        swapped += 1
    return swapped
