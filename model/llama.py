"""The one decoder of every supported family, over a flat token batch and a paged KV cache.

RMSNorm, RoPE, grouped-query attention, SwiGLU MLP, tied or untied LM head, as in
Hugging Face ``transformers`` ``LlamaForCausalLM`` (Touvron et al., "LLaMA", 2023), with the
other families' differences as options of :class:`~model.config.ModelConfig` (:mod:`model.families`):
``qkv_bias`` / ``o_proj_bias`` / ``mlp_bias`` (Qwen2's q/k/v biases), ``qk_norm`` (Qwen3's per-head
RMSNorm of queries and keys before RoPE) and an explicit ``head_dim`` (Qwen3, Mistral). It follows
``transformers``' order of operations for each family so that greedy output is token-exact in float32.
Q/K/V and gate/up projections are fused into one matmul each (as vLLM does);
:mod:`model.loader` concatenates the checkpoint's weights. On CPUs, decode-sized steps run
RMSNorm, RoPE with the KV write, attention and SiLU-and-mul as C kernels (:mod:`kernels.cpu`):
RoPE and SiLU round as the torch code here (bit-identical in bf16), RMSNorm too up to the order of
its sum of squares (16 lanes on AVX-512, where bf16 prefill rows take it as well); attention accumulates
in float32 where the torch path's SDPA rounds in bf16, so bf16 logits differ slightly between
the two paths (and a near-tie can pick another token). Where every projection runs on a C kernel
too (packed bf16 or INT4), all layers of such a step run in one C call (:mod:`model.cpu_stack`),
bit-identical to the per-operation path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.cpu import fused
from pdserve.kernels.cpu.attention import paged_attention_cpu, prefill_attention_available
from pdserve.kernels.paged_attention import AttentionMetadata, paged_attention, write_kv
from pdserve.model.config import ModelConfig
from pdserve.model.cpu_stack import decode_stack
from pdserve.model.moe import SparseMoeBlock
from pdserve.model.rope import RotaryEmbedding, apply_rotary


def triton_elementwise(x: torch.Tensor) -> bool:
    """Whether RMSNorm, SiLU-and-mul and RoPE with the KV write run as Triton kernels
    (:mod:`kernels.fused_triton`): on CUDA. Tests patch it to run them under the interpreter."""
    return x.is_cuda


def _fused_triton():
    from pdserve.kernels import fused_triton  # Triton only where it runs
    return fused_triton


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich, 2019), computed in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, cpu_kernel: bool = False, residual: torch.Tensor | None = None):
        """``x`` ``[rows, dim]`` -> normed rows; with ``residual``, ``s = x + residual`` first (rounded to
        their dtype) and ``(norm(s), s)`` returned: a layer's residual add fused into the next norm where
        the C kernel runs (vLLM's ``fused_add_rms_norm``), bit-identical to the two operations."""
        c_kernel = cpu_kernel or (x.dtype == torch.bfloat16 == self.weight.dtype and x.dim() == 2 and x.is_cpu
                                  and x.stride(1) == 1 and fused.vectorized())    # prefill-sized bf16 rows too
        if residual is not None:
            if c_kernel and residual.dtype == x.dtype and residual.stride(-1) == 1:
                return fused.add_rms_norm(x, residual, self.weight, self.eps)
            s = x + residual
            return self(s, cpu_kernel), s
        if c_kernel:
            return fused.rms_norm(x, self.weight, self.eps)
        if triton_elementwise(x) and x.dtype == self.weight.dtype:
            return _fused_triton().rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    """Grouped-query self-attention of one layer, reading and writing the paged cache."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.cfg = layer, cfg
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        if cfg.qk_norm:  # Qwen3: RMSNorm over each head's features, one weight shared by all heads
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.attention_scale

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, cpu_kernels: bool = False) -> torch.Tensor:
        n, cfg = x.shape[0], self.cfg
        qkv = self.qkv_proj(x)
        norms = (self.q_norm.weight, self.k_norm.weight, cfg.rms_norm_eps) if cfg.qk_norm else ()
        if cpu_kernels:
            # CPU, decode-sized: (q/k norm +) RoPE + cache write and attention in two C calls
            q = fused.rope_write_kv(qkv, cos, sin, kv_cache, self.layer, meta.slot_mapping,
                                    cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, *norms)
            out = paged_attention_cpu(q, kv_cache, self.layer, meta.query_start_loc, meta.seq_lens,
                                      meta.block_tables, self.scale)
            return self.o_proj(out.view(n, self.q_size).to(x.dtype))
        if self._c_prefill(qkv, kv_cache):
            # CPU, bf16 rows of a prefill chunk: (q/k norm +) RoPE + cache write in C, the C prefill attention
            # on bf16 q
            q = fused.rope_write_kv(qkv, cos, sin, kv_cache, self.layer, meta.slot_mapping, cfg.num_heads,
                                    cfg.num_kv_heads, cfg.head_dim, *norms, q_dtype=qkv.dtype)
            out = paged_attention(q, None, None, kv_cache, self.layer, meta, self.scale)
            return self.o_proj(out.reshape(n, self.q_size))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.reshape(n, cfg.num_heads, cfg.head_dim), k.reshape(n, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        v = v.view(n, cfg.num_kv_heads, cfg.head_dim)
        if triton_elementwise(qkv):
            q, k = _fused_triton().rope_write_kv(q, k, v, cos, sin, kv_cache, self.layer, meta.slot_mapping)
        else:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            write_kv(kv_cache, self.layer, k, v, meta.slot_mapping)
        out = paged_attention(q, k, v, kv_cache, self.layer, meta, self.scale)
        return self.o_proj(out.reshape(n, self.q_size))

    def _c_prefill(self, qkv: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether a step's (q/k norm +) RoPE + KV write runs in C ahead of the C prefill attention: bf16 rows,
        cache (and q/k norm weights) on a CPU where both run vectorized (AVX-512; heads a multiple of 32),
        bit-identical to the torch code (``apply_rotary``, ``write_kv``); a q/k norm (Qwen3) as the C
        RMSNorm (:func:`kernels.cpu.fused.rms_norm`) normalizes each head, within the order of its sum
        of squares of torch's."""
        return (qkv.dtype == kv_cache.dtype == torch.bfloat16 and qkv.is_cpu and qkv.stride(1) == 1
                and (not self.cfg.qk_norm or self.q_norm.weight.dtype == self.k_norm.weight.dtype == qkv.dtype)
                and self.cfg.head_dim % 32 == 0 and self.cfg.head_dim <= fused.MAX_HEAD_DIM
                and fused.vectorized() and prefill_attention_available(self.cfg.head_dim))


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))`` (Shazeer, 2020)."""

    def __init__(self, cfg: ModelConfig, intermediate: int | None = None) -> None:
        super().__init__()
        self.intermediate = intermediate or cfg.intermediate_size   # an expert's (model.moe) where given
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.intermediate, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(self.intermediate, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, cpu_kernels: bool = False) -> torch.Tensor:
        # a gate_up held in pieces (model.onednn_linear.OneDNNGateUp, a colocated worker's PackedBF16Linear)
        fused_silu = getattr(self.gate_up_proj, "silu_mul", None)
        if fused_silu is not None:
            return self.down_proj(fused_silu(x))
        gate_up = self.gate_up_proj(x)
        if cpu_kernels or self._c_silu(gate_up):
            return self.down_proj(fused.silu_and_mul(gate_up))
        if triton_elementwise(gate_up):
            return self.down_proj(_fused_triton().silu_and_mul(gate_up.view(-1, 2 * self.intermediate))
                                  .view(*gate_up.shape[:-1], self.intermediate))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    @staticmethod
    def _c_silu(gate_up: torch.Tensor) -> bool:
        """Whether SiLU-and-mul of a step of any size runs in C: bf16 row-major rows on a CPU where it runs
        vectorized (AVX-512), bit-identical to ``F.silu(gate) * up`` but for a rare one-ulp rounding
        (:func:`kernels.cpu.fused.silu_and_mul`)."""
        return (gate_up.dtype == torch.bfloat16 and gate_up.dim() == 2 and gate_up.is_cpu
                and gate_up.stride(1) == 1 and fused.vectorized())


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residual connections."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoeBlock(cfg, MLP) if layer in cfg.moe_layers else MLP(cfg)

    def forward(self, x, residual, cos, sin, kv_cache, meta, cpu_kernels: bool = False):
        """``x``: the previous layer's output ``[num_tokens, hidden]`` and ``residual`` the stream it adds to
        (None at the first layer, where ``x`` is the stream) -> this layer's ``(output, residual)``: each
        residual add runs inside the norm after it, as vLLM's layers pass them."""
        if residual is None:
            h, residual = self.input_layernorm(x, cpu_kernels), x
        else:
            h, residual = self.input_layernorm(x, cpu_kernels, residual)
        h = self.self_attn(h, cos, sin, kv_cache, meta, cpu_kernels)
        h, residual = self.post_attention_layernorm(h, cpu_kernels, residual)
        return self.mlp(h, cpu_kernels), residual


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head, for every supported family (the name is kept for the workers' API).

    ``forward`` takes a flat batch of ``num_tokens`` token ids from any mix of
    prefill chunks and decode steps, writes their KV into ``kv_cache`` and returns
    hidden states; ``compute_logits`` turns the rows that need sampling into logits.
    ``cpu_stack``: decode-sized CPU steps run all layers in one C call where the projections allow
    it (:mod:`model.cpu_stack`; bit-identical to the per-operation C-kernel path).
    """

    cpu_stack: bool = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # Built on the meta device and filled from the checkpoint: no init. (torch's normal_ init on meta runs a
        # decomposition that imports torch._dynamo: 2-3 s of every worker process's start.)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor,
                num_layers: int | None = None) -> torch.Tensor:
        """``input_ids`` ``[num_tokens]`` int64 -> hidden states ``[num_tokens, hidden_size]``.

        ``kv_cache`` (``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``) is
        written at ``meta.slot_mapping`` and read through the metadata's block indices.
        ``num_layers`` runs only the first layers (then the final norm): the self-draft of
        speculative decoding; their KV goes to the same cache slots the full model uses.
        """
        cos, sin = self.rotary.cos_sin(meta.positions)
        x = self.embed_tokens(input_ids)
        # the fused C kernels (norm, RoPE + KV write, SiLU): the step's metadata allows them, and the
        # model computes in its cache's dtype; attention follows meta.cpu_kernels alone
        cpu_kernels = meta.cpu_kernels and kv_cache.dtype == x.dtype and self.cfg.head_dim <= fused.MAX_HEAD_DIM
        if cpu_kernels and self.cpu_stack and (stack := decode_stack(self)) is not None:
            return stack.run(x, cos, sin, kv_cache, meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
                             meta.block_tables, num_layers)
        residual = None
        for layer in self.layers[:num_layers]:
            x, residual = layer(x, residual, cos, sin, kv_cache, meta, cpu_kernels)
        return self.norm(x, cpu_kernels) if residual is None else self.norm(x, cpu_kernels, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden_size]`` -> ``[n, vocab_size]`` float32 logits."""
        return self.lm_head(hidden).float()
