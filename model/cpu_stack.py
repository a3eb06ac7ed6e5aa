"""The model's decoder layers as one :class:`~kernels.cpu.decode_stack.DecodeStack` for CPU decode steps.

:func:`decode_stack` builds the stack from a :class:`~model.llama.LlamaForCausalLM` whose projections
all run on the C kernels at decode sizes (:class:`~model.cpu_linear.PackedBF16Linear`, or
:class:`~model.quant.int4.Int4Linear` on its ``int4-vnni`` layout) and keeps it beside the model
(not in it: a ``copy.deepcopy`` of the model builds its own); it is rebuilt when a weight has moved
(:meth:`DecodeStack.valid`, e.g. after :func:`model.hugepages.move_to_huge_pages`). Any other
projection (``nn.Linear``, FP8, the torch INT4 layout) leaves the model on the per-operation path, as
does ``LlamaForCausalLM.cpu_stack = False``. :func:`decode_graph` binds the stack, the embedding and
the LM head to a graph runner's static buffers (:class:`~kernels.cpu.decode_graph.DecodeGraph`).
"""

from __future__ import annotations

import logging
import weakref

import torch

from pdserve.kernels.cpu import KernelUnavailable, fused
from pdserve.kernels.cpu.decode_graph import DecodeGraph
from pdserve.kernels.cpu.decode_stack import DecodeStack, LayerSpec, LinearSpec, MoeSpec, stack_available
from pdserve.kernels.cpu.moe_block import MoeBlock
from pdserve.model.cpu_linear import PackedBF16Linear, gemv_max_rows
from pdserve.model.quant.int4 import VNNI, Int4Linear

log = logging.getLogger(__name__)
_STACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # model -> (stack or None, what to re-check)


def _linear_spec(module: torch.nn.Module) -> LinearSpec | None:
    if type(module) is PackedBF16Linear:
        if module.in_features % 2:
            return None
        return LinearSpec("bf16", module.packed, module.out_features, module.in_features, module.bias,
                          gemv_max_rows=gemv_max_rows(module.amx), amx=module.amx)
    if type(module) is Int4Linear and module.scales.device.type == "cpu" and not module.exact_cpu:
        module.prepare()
        if module.kernel_for(1) != VNNI or module._vnni is None:
            return None
        wq, scales, zc = module._vnni
        return LinearSpec("int4", wq, module.out_features, module.in_features, module.bias, scales, zc,
                          module.group_size)
    return None


def _moe_spec(block) -> MoeSpec | None:
    """A mixture's :class:`MoeSpec` (:class:`model.moe.SparseMoeBlock`), or None unless its router and every
    expert's projections are on the C kernels and it has no shared expert (Qwen2-MoE's runs per operation)."""
    if block.shared_expert is not None:
        return None
    router = _linear_spec(block.gate)
    gate_up = tuple(_linear_spec(e.gate_up_proj) for e in block.experts)
    down = tuple(_linear_spec(e.down_proj) for e in block.experts)
    if router is None or None in gate_up or None in down:
        return None
    return MoeSpec(router, gate_up, down, block.top_k, block.renormalize, block.float_weights,
                   block.experts[0].intermediate)


_BLOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # mixture -> (what it was built for, block)


def moe_block(block, dtype: torch.dtype) -> MoeBlock | None:
    """The mixture ``block`` (:class:`model.moe.SparseMoeBlock`) as one C call for activations of ``dtype``
    (:class:`~kernels.cpu.moe_block.MoeBlock`), built on first use and again once its weights have moved or its
    projections were replaced; None where its router or an expert is not on the C kernels, it has a shared
    expert, or no library builds here."""
    key = (dtype, type(block.gate), type(block.experts[0].gate_up_proj), type(block.experts[0].down_proj))
    cached = _BLOCKS.get(block)
    if cached is not None and cached[0] == key and (cached[1] is None or cached[1].valid()):
        return cached[1]
    built, spec = None, _moe_spec(block)
    kinds = {s.kind for s in (spec.router, *spec.gate_up, *spec.down)} if spec is not None else set()
    if spec is not None and stack_available(int4="int4" in kinds, bf16_packed="bf16" in kinds):
        try:
            built = MoeBlock(spec, spec.router.in_features, dtype)
        except (ValueError, KernelUnavailable) as exc:
            log.info("no C mixture block for this model: %s", exc)
    _BLOCKS[block] = (key, built)
    return built


def build_decode_stack(model) -> DecodeStack | None:
    """A :class:`DecodeStack` over ``model``'s current weights, or ``None`` where one cannot serve it
    (a projection the stack does not take, a library that does not build)."""
    cfg = model.cfg
    specs = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        sparse = hasattr(mlp, "experts")             # a mixture of experts (model.moe)
        attention = [_linear_spec(attn.qkv_proj), _linear_spec(attn.o_proj)]
        ffn = [_moe_spec(mlp)] if sparse else [_linear_spec(mlp.gate_up_proj), _linear_spec(mlp.down_proj)]
        if None in attention + ffn:
            return None
        norms = (attn.q_norm.weight, attn.k_norm.weight) if cfg.qk_norm else (None, None)
        specs.append(LayerSpec(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, *attention,
                               *((None, None) if sparse else ffn), q_norm=norms[0], k_norm=norms[1],
                               moe=ffn[0] if sparse else None))
    kinds = {spec.kind for s in specs for spec in (s.qkv, s.o, s.gate_up, s.down) if spec is not None}
    if not stack_available(int4="int4" in kinds, bf16_packed="bf16" in kinds):
        return None
    try:
        return DecodeStack(specs, model.norm.weight, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                           cfg.intermediate_size, cfg.rms_norm_eps, cfg.attention_scale, model.norm.weight.dtype)
    except (ValueError, KernelUnavailable) as exc:
        log.info("no decode stack for this model: %s", exc)
        return None


def decode_stack(model) -> DecodeStack | None:
    """The model's stack, built on first use and rebuilt when its weights have moved or an INT4
    projection was switched to ``exact_cpu``; ``None`` if the model cannot use one (looked at again
    once the first or last projection is replaced, as :func:`model.cpu_linear.pack_for_cpu_decode` does)."""
    cached = _STACKS.get(model)
    if cached is not None:
        stack, int4_modules = cached
        if stack is None:
            if int4_modules == _fingerprint(model):
                return None
        elif stack.valid() and not any(m.exact_cpu for m in int4_modules):
            return stack
    stack = build_decode_stack(model)
    int4_modules = [m for m in model.modules() if type(m) is Int4Linear]
    _STACKS[model] = (stack, int4_modules if stack is not None else _fingerprint(model))
    return stack


def _fingerprint(model) -> tuple:
    """The types of the first and the last projection: where they change, the model is looked at again."""
    last = model.layers[-1]
    return type(model.layers[0].self_attn.qkv_proj), type(getattr(last.mlp, "down_proj", last.self_attn.o_proj))


def decode_graph(model, input_ids: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                 kv_cache: torch.Tensor, max_positions: int, current: DecodeGraph | None = None) -> DecodeGraph | None:
    """A :class:`DecodeGraph` running ``model``'s whole decode step over the given static buffers (see
    :class:`DecodeGraph` for their shapes), or ``None`` where the step cannot run so: no decode stack
    (:func:`decode_stack`), an LM head the stack does not take (not packed bf16 or INT4), a cache not of the
    model's dtype, or ``model.cpu_stack`` off. ``current``: the graph returned before, returned again while
    the stack it runs is still the model's."""
    if not model.cpu_stack or kv_cache.dtype != model.embed_tokens.weight.dtype \
            or model.cfg.head_dim > fused.MAX_HEAD_DIM:
        return None
    stack = decode_stack(model)                      # checked the stack's tensors: the graph checks its own only
    if stack is None or (current is not None and current.stack is stack and current.buffers_valid()):
        return current if stack is not None else None
    head = _linear_spec(model.lm_head)
    if head is None:
        return None
    return DecodeGraph(stack, model.embed_tokens.weight, head, model.rotary.cos_sin, input_ids, seq_lens,
                       block_tables, kv_cache, max_positions)
