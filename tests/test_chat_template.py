"""Chat templates (model/chat_template.py): found where transformers finds them, rendered and tokenized
exactly as ``apply_chat_template`` does, sandboxed, and failing with messages that say why."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pdserve.deploy.config import EMBEDDED_MODEL
from pdserve.model.chat_template import ChatTemplate, ChatTemplateError

CHATML = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONVERSATIONS = [
    [{"role": "user", "content": "Tell me a story about a dog."}],
    [{"role": "system", "content": "You tell short stories."}, {"role": "user", "content": "A cat"},
     {"role": "assistant", "content": "Once upon a time, there was a cat."}, {"role": "user", "content": "More"}],
    [{"role": "user", "content": "Ünïcödé ✓ and \"quotes\" <|im_end|> inside"}],
]


def checkpoint_with(tmp_path: Path, template=None, beside: str | None = None) -> Path:
    """A copy of the embedded model with ``template`` as tokenizer_config.json's ``chat_template`` and
    ``beside`` as its chat_template.jinja."""
    out = tmp_path / "tinystories-chat"
    shutil.copytree(EMBEDDED_MODEL, out)
    if template is not None:
        cfg = json.loads((out / "tokenizer_config.json").read_text())
        cfg["chat_template"] = template
        (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    if beside is not None:
        (out / "chat_template.jinja").write_text(beside)
    return out


def test_rendered_and_tokenized_as_transformers_does(tmp_path):
    from transformers import AutoTokenizer

    model_dir = checkpoint_with(tmp_path, CHATML)
    template, hf = ChatTemplate.load(model_dir), AutoTokenizer.from_pretrained(model_dir)
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            text = template.render(messages, add_generation_prompt=add_generation_prompt)
            assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
            if not text.isascii():  # transformers rebuilds this Llama tokenizer, and it maps unknown characters
                continue            # differently from tokenizer.json (which the router's own Tokenizer follows)
            ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
            ids = ids if isinstance(ids, list) else ids["input_ids"]
            assert template.encode(text) == ids
    text = template.render(CONVERSATIONS[0])
    assert text.startswith("<|start_story|><|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
    assert template.encode(text).count(1) == 1  # one BOS: the template's, none added by the tokenizer


def test_tojson_and_the_transformers_globals(tmp_path):
    model_dir = checkpoint_with(tmp_path, "{{ messages | tojson }}#{{ messages[0] | tojson(indent=2) }}#"
                                          "{{ strftime_now('%Y') | length }}#{{ eos_token }}"
                                          "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                                          "{% generation %}[{{ m.role }}]{% endgeneration %}{% endfor %}")
    out = ChatTemplate.load(model_dir).render([{"role": "user", "content": "é <b>"}, {"role": "user", "content": "x"}])
    as_json, indented, year, rest = out.split("#")
    assert json.loads(as_json)[0]["content"] == "é <b>" and "é <b>" in as_json  # not HTML-escaped, not ASCII-escaped
    assert indented == json.dumps({"role": "user", "content": "é <b>"}, ensure_ascii=False, indent=2)
    assert year == "4" and rest == "<|end_story|>[user]"


def test_where_the_template_comes_from(tmp_path):
    assert ChatTemplate.load(EMBEDDED_MODEL) is None  # the embedded model has none
    model_dir = checkpoint_with(tmp_path, "config:{{ messages[0].content }}", beside="file:{{ messages[0].content }}")
    msgs = [{"role": "user", "content": "hi"}]
    assert ChatTemplate.load(model_dir).render(msgs) == "file:hi"  # chat_template.jinja wins, as in transformers
    (model_dir / "chat_template.jinja").unlink()
    assert ChatTemplate.load(model_dir).render(msgs) == "config:hi"
    override = tmp_path / "mine.jinja"
    override.write_text("override:{{ messages[0].content }}")
    assert ChatTemplate.load(model_dir, override).render(msgs) == "override:hi"
    assert ChatTemplate.load(EMBEDDED_MODEL, override).render(msgs) == "override:hi"
    with pytest.raises(ValueError, match="cannot be read"):
        ChatTemplate.load(model_dir, tmp_path / "missing.jinja")


def test_named_templates_use_the_default_one(tmp_path):
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "default:{{ bos_token }}"}]
    assert ChatTemplate.load(checkpoint_with(tmp_path, named)).render([]) == "default:<|start_story|>"
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(ValueError, match="no 'default'"):
        ChatTemplate.load(checkpoint_with(other, [{"name": "tool_use", "template": "tools"}]))


def test_syntax_errors_fail_at_load_and_refusals_at_render(tmp_path):
    with pytest.raises(ValueError, match="line 1"):
        ChatTemplate.load(checkpoint_with(tmp_path, "{% for m in messages %}unclosed"))
    strict = tmp_path / "strict.jinja"
    strict.write_text("{% if messages[0].role != 'user' %}{{ raise_exception('the first message must be from the "
                      "user') }}{% endif %}{{ messages[0].content + 1 }}")
    template = ChatTemplate.load(EMBEDDED_MODEL, strict)
    with pytest.raises(ChatTemplateError, match="the first message must be from the user"):
        template.render([{"role": "system", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="TypeError"):
        template.render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("source", [
    "{{ messages.__class__.__mro__ }}",
    "{{ ''.__class__.__subclasses__() }}",
    "{{ messages.append({'role': 'system', 'content': 'injected'}) }}",
    "{% set _ = messages[0].update({'content': 'changed'}) %}",
    "{{ cycler.__init__.__globals__ }}",
])
def test_the_sandbox_keeps_templates_away_from_python(tmp_path, source):
    path = tmp_path / "evil.jinja"
    path.write_text(source)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateError):
        ChatTemplate.load(EMBEDDED_MODEL, path).render(messages)
    assert messages == [{"role": "user", "content": "hi"}]


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city, now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_tools_reach_the_template_as_transformers_passes_them(tmp_path):
    from transformers import AutoTokenizer

    named = [{"name": "default", "template": "default:{{ tools is none }}:{{ documents is none }}:"
                                             "{{ messages[0].content }}"},
             {"name": "tool_use", "template": "tool_use:{% for t in tools %}{{ t | tojson }}{% endfor %}:"
                                              "{{ messages[0].content }}"}]
    model_dir = checkpoint_with(tmp_path, named)
    template, hf = ChatTemplate.load(model_dir), AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "Paris?"}]
    for tools in (None, TOOLS):   # a request with tools renders the tool_use template, as transformers picks it
        assert template.render(messages, tools=tools) == hf.apply_chat_template(messages, tools=tools, tokenize=False)
    assert template.render(messages) == "default:True:True:Paris?"
    assert template.render(messages, tools=TOOLS).startswith('tool_use:{"type": "function", "function": {"name": "get_')
    one = checkpoint_with(tmp_path / "one", "{% if tools %}{{ tools | length }} tools{% endif %}")  # one template
    assert ChatTemplate.load(one).render(messages, tools=TOOLS) == "1 tools"
