"""GPTQ for the INT4 format of :mod:`model.quant.int4`: rounding that compensates each column's
error on the columns not yet quantized, weighted by the layer's input statistics.

For a linear layer with inputs ``X`` (calibration tokens x K), GPTQ minimises the output error
``||X W^T - X Q^T||`` column by column: after rounding column ``k`` with error ``e``, the columns
to its right are updated by ``-e * Hinv[k, k:] / Hinv[k, k]`` where ``H = 2 X^T X`` (damped). Group
scales and zero points are chosen (by :mod:`model.quant.int4`'s clip search) when the loop reaches
each group's first column, from the weights as updated so far. Frantar et al., "GPTQ: Accurate
Post-Training Quantization for Generative Pre-trained Transformers", ICLR 2023 (Algorithm 1, with
lazy batch updates and the Cholesky form of the inverse Hessian).

Calibration needs no data set: :func:`self_generated_calibration` samples token sequences from the
float model itself (data-free calibration, as in LLM-QAT, Liu et al. 2023), so load-time
quantization of any checkpoint works offline. Hessians come from one pass of the float model
(not layer by layer through already-quantized layers, as the reference implementation does).

Measured on TinyStories-656K (``pytest -q -s tests/test_int4.py -k agreement``: teacher-forced
top-1 agreement with the float32 model over 513 positions of 3 greedy continuations; 32 x 256
calibration tokens): group 128: 83.8% / mean KL 0.057 with the ``mse`` clip search, 87.1% / 0.037
with GPTQ; group 32: 87.7% / 0.032 and 90.6% / 0.023.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.paged_attention import build_attention_metadata
from pdserve.model.kv_cache import KVCacheSpec
from pdserve.model.quant.int4_format import pack_int4, padded_in_features, quantize_groups, round_q

DAMP = 0.01          # fraction of the mean Hessian diagonal added to it (GPTQ's percdamp)
BLOCK = 128          # columns per lazy batch update


def gptq_quantize_weight(weight: torch.Tensor, hessian: torch.Tensor, group_size: int,
                         method: str = "mse") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ-quantize ``weight`` ``[N, K]`` to the module format of :mod:`model.quant.int4`.

    Args:
        weight: ``[N, K]`` float weight.
        hessian: ``[K, K]`` float32 ``sum x x^T`` over calibration inputs (any positive scale).
        group_size: input columns per scale group.
        method: how each group's scale and zero point are chosen (``"mse"`` or ``"rtn"``).
    Returns:
        ``(qweight uint8 [N, Kp // 2], scales float32 [N, Kp // G], zeros float32 [N, Kp // G])``.
    Raises:
        ValueError: ``hessian`` is not ``[K, K]``.
    """
    n, k = weight.shape
    if hessian.shape != (k, k):
        raise ValueError(f"gptq: hessian must be [{k}, {k}], got {tuple(hessian.shape)}")
    kp = padded_in_features(k, group_size)
    w = F.pad(weight.detach().float(), (0, kp - k))
    h = torch.zeros(kp, kp)
    h[:k, :k] = hessian.float()
    dead = h.diagonal() == 0                      # inputs never seen (and padding): weight is free
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h.diagonal().add_(DAMP * h.diagonal()[:k].mean())           # the real columns' mean
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros(n, kp)
    scales = torch.zeros(n, kp // group_size)
    mins = torch.zeros(n, kp // group_size)
    for b0 in range(0, kp, BLOCK):
        b1 = min(b0 + BLOCK, kp)
        wb, err = w[:, b0:b1].clone(), torch.zeros(n, b1 - b0)
        for i in range(b1 - b0):
            col = b0 + i
            g = col // group_size
            if col % group_size == 0:             # the group's scale from the weights as updated so far
                grp = wb[:, i:i + group_size] if i + group_size <= b1 - b0 else w[:, col:col + group_size]
                valid = None if col + group_size <= k else (torch.arange(col, col + group_size) < k).float().view(
                    1, 1, group_size)                 # padding columns stay out of the statistics
                _, s, m = quantize_groups(grp.reshape(n, 1, group_size).clone(), valid, method)
                scales[:, g], mins[:, g] = s.view(n), m.view(n)
            s, m = scales[:, g], mins[:, g]
            qc = round_q(wb[:, i], s, m)
            q[:, col] = qc
            e = (wb[:, i] - (qc * s + m)) / hinv[col, col]
            wb[:, i:] -= e[:, None] * hinv[col, col:b1][None, :]
            err[:, i] = e
        w[:, b1:] -= err @ hinv[b0:b1, b1:]
    return pack_int4(q), scales, mins + 8 * scales


@torch.inference_mode()
def self_generated_calibration(model: nn.Module, cfg, num_sequences: int = 16, length: int = 128,
                               seed: int = 0) -> list[list[int]]:
    """``num_sequences`` token sequences of ``length`` sampled (temperature 1) from ``model`` itself,
    each starting at BOS (or token 1): calibration text with the model's own statistics."""
    gen = torch.Generator().manual_seed(seed)
    bos = cfg.bos_token_id if cfg.bos_token_id is not None else 1
    length = min(length, cfg.max_position_embeddings)
    seqs = [[bos] for _ in range(num_sequences)]
    bs = 16
    blocks = -(-length // bs)
    spec = KVCacheSpec(num_sequences * blocks, cfg.num_layers, bs, cfg.num_kv_heads, cfg.head_dim)
    cache = spec.allocate("cpu")
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(num_sequences)]
    dtype = next(model.parameters()).dtype
    cache = cache.to(dtype)
    for pos in range(length - 1):
        meta = build_attention_metadata([1] * num_sequences, [pos + 1] * num_sequences, tables, bs, "cpu", cache.dtype)
        ids = torch.tensor([s[-1] for s in seqs])
        logits = model.compute_logits(model(ids, meta, cache))
        nxt = torch.multinomial(logits.float().softmax(-1), 1, generator=gen).view(-1)
        for s, t in zip(seqs, nxt.tolist()):
            s.append(t)
    return seqs


@torch.inference_mode()
def collect_hessians(model: nn.Module, cfg, sequences: list[list[int]],
                     names: list[str]) -> dict[str, torch.Tensor]:
    """``sum x x^T`` (float32 ``[K, K]``) of the inputs of each named ``nn.Linear`` over ``sequences``,
    each run as one prompt through the float model."""
    hess: dict[str, torch.Tensor] = {}
    hooks = []
    for name in names:
        mod = model.get_submodule(name)

        def hook(_m, inputs, _out, name=name):
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).float()
            hess[name] = hess.get(name, 0) + x.t() @ x
        hooks.append(mod.register_forward_hook(hook))
    try:
        bs = 16
        for seq in sequences:
            table = list(range(-(-len(seq) // bs)))
            spec = KVCacheSpec(len(table), cfg.num_layers, bs, cfg.num_kv_heads, cfg.head_dim)
            cache = spec.allocate("cpu").to(next(model.parameters()).dtype)
            model(torch.tensor(seq), build_attention_metadata([len(seq)], [len(seq)], [table], bs, "cpu", cache.dtype),
                  cache)
    finally:
        for h in hooks:
            h.remove()
    return hess


def gptq_quantize_model(model: nn.Module, linears: list[nn.Linear], group_size: int,
                        num_sequences: int = 32, length: int = 256) -> dict[nn.Module, tuple]:
    """GPTQ every one of ``linears`` (modules of ``model``) from one calibration pass of the float
    model over :func:`self_generated_calibration` text. Returns module -> ``(q, s, z)``."""
    if not linears:
        return {}
    names = {mod: name for name, mod in model.named_modules()}
    seqs = self_generated_calibration(model, model.cfg, num_sequences, length)
    hess = collect_hessians(model, model.cfg, seqs, [names[m] for m in linears])
    return {mod: gptq_quantize_weight(mod.weight, hess[names[mod]], group_size) for mod in linears}
