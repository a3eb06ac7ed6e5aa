"""A checkpoint whose greedy answer is written in advance, for end-to-end tests of what the serving path does
with a model's text (tool calls) without a trained model.

The embedded model's tokenizer gains one added token per piece of the answer and a special ``<|assistant|>``
token that the chat template writes last. The model is a Llama whose one layer adds nothing to the residual
(attention and MLP weights zero), so the last hidden state is the current token's embedding: the embeddings of
``<|assistant|>`` and of the pieces are orthogonal unit vectors (times 8), and the LM head maps each onto the
next piece (the last onto EOS) with a logit of 80 against at most ~1 for any other token. Greedy decoding
therefore writes the pieces in order after any prompt that ends with ``<|assistant|>``, and stops.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer

from pdserve.deploy.config import EMBEDDED_MODEL

ASSISTANT = "<|assistant|>"
HIDDEN = 64
# a ChatML-like template that shows tools and past calls, ending with the token the script starts from
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}" + ASSISTANT + "{% endif %}")


def scripted_chat_model(out: Path, answer: list[str], template: str = TEMPLATE, special: tuple[str, ...] = ()
                        ) -> Path:
    """Write to ``out`` a checkpoint whose greedy answer to a prompt ending in ``<|assistant|>`` is the
    distinct pieces ``answer`` (each one token; those in ``special`` special tokens), then EOS; ``template`` is
    its chat template. Returns ``out``."""
    if len(set(answer)) != len(answer) or len(answer) + 1 > HIDDEN:
        raise ValueError("the pieces must be distinct, and fewer than the hidden size")
    out.mkdir(parents=True)
    tok = Tokenizer.from_file(str(Path(EMBEDDED_MODEL) / "tokenizer.json"))
    base = tok.get_vocab_size()
    tok.add_tokens([AddedToken(p, special=p in special, normalized=False) for p in answer])
    tok.add_special_tokens([AddedToken(ASSISTANT, special=True, normalized=False)])
    tok.save(str(out / "tokenizer.json"))
    chain = [tok.token_to_id(ASSISTANT)] + [tok.token_to_id(p) for p in answer]
    assert chain[1:] == list(range(base, base + len(answer))), "each piece must be one new token"
    cfg = json.loads((Path(EMBEDDED_MODEL) / "config.json").read_text())
    vocab = -(-tok.get_vocab_size() // 64) * 64
    cfg.update(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=vocab, tie_word_embeddings=False, torch_dtype="float32")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tok_cfg = json.loads((Path(EMBEDDED_MODEL) / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "chat_template": template}, indent=2))
    for name in ("special_tokens_map.json", "generation_config.json"):
        shutil.copy(Path(EMBEDDED_MODEL) / name, out / name)
    save_file(_weights(cfg, chain), str(out / "model.safetensors"))
    return out


def _weights(cfg: dict, chain: list[int]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    vocab, hidden, inter = cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = hidden // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim
    embed = torch.randn(vocab, hidden, generator=g)
    head = torch.randn(vocab, hidden, generator=g) * 0.01
    embed[chain] = 0.0
    for i, token in enumerate(chain):
        embed[token, i] = 8.0
        head[chain[i + 1] if i + 1 < len(chain) else cfg["eos_token_id"], i] = 10.0
    p = "model.layers.0."
    zeros = {f"{p}self_attn.q_proj.weight": (hidden, hidden), f"{p}self_attn.k_proj.weight": (kv, hidden),
             f"{p}self_attn.v_proj.weight": (kv, hidden), f"{p}self_attn.o_proj.weight": (hidden, hidden),
             f"{p}mlp.gate_proj.weight": (inter, hidden), f"{p}mlp.up_proj.weight": (inter, hidden),
             f"{p}mlp.down_proj.weight": (hidden, inter)}
    out = {name: torch.zeros(shape) for name, shape in zeros.items()}
    out.update({"model.embed_tokens.weight": embed, "lm_head.weight": head, "model.norm.weight": torch.ones(hidden),
                f"{p}input_layernorm.weight": torch.ones(hidden),
                f"{p}post_attention_layernorm.weight": torch.ones(hidden)})
    return out


JSON_TOKENS = ["{", "}", "[", "]", "true", "false", "null"]


def json_capable_model(out: Path, template: str | None = None) -> Path:
    """Write to ``out`` the embedded TinyStories model with the tokens JSON needs and its vocabulary lacks
    (``JSON_TOKENS``, added tokens) and their embeddings (seeded, the size of the others), so that grammars of
    JSON can be served with a trained model; ``template``: a chat template for it. Returns ``out``."""
    shutil.copytree(EMBEDDED_MODEL, out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    base = tok.get_vocab_size()
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in JSON_TOKENS])
    tok.save(str(out / "tokenizer.json"))
    cfg = json.loads((out / "config.json").read_text())
    weights = load_file(str(out / "model.safetensors"))
    head = weights["lm_head.weight"]                     # tied: the embeddings too
    vocab = -(-(base + len(JSON_TOKENS)) // 64) * 64
    extra = torch.randn(vocab - head.shape[0], head.shape[1], generator=torch.Generator().manual_seed(1)) * head.std()
    weights["lm_head.weight"] = torch.cat([head, extra.to(head.dtype)])
    save_file(weights, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({**cfg, "vocab_size": vocab}, indent=2))
    if template is not None:
        tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
        (out / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "chat_template": template}, indent=2))
    return out


CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
THOUGHT = "The user wants the weather."
THINKING_ANSWER = ["<think>", THOUGHT, "</think>", "Checking.", "<tool_call>", CALL, "</tool_call>"]


def thinking_cluster(redis_url: str, out: Path):
    """A cluster (tests.clusters.Cluster) serving at ``out`` a scripted checkpoint whose answer thinks, says
    "Checking." and calls ``get_weather`` for Paris (:data:`THINKING_ANSWER`), behind a router that serves HTTP
    with ``--reasoning-parser qwen3 --tool-call-parser hermes``."""
    from tests.clusters import Cluster

    path = scripted_chat_model(out, THINKING_ANSWER)
    return Cluster(str(path), redis_url, router_flags={"http_port": 0, "tool_call_parser": "hermes",
                                                       "reasoning_parser": "qwen3"})
