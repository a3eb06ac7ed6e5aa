"""Chat templates: a conversation rendered into the prompt the checkpoint was trained on, as
``transformers``' ``apply_chat_template`` renders and tokenizes it::

    messages ──Jinja (sandboxed)──► prompt text ──tokenizer, no special tokens added──► prompt ids
              bos/eos tokens,         "<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n"
              add_generation_prompt

The template is the operator's file (``--chat-template``), else the checkpoint's ``chat_template.jinja``,
else the ``chat_template`` of its ``tokenizer_config.json`` (a string, or a list of named templates: ``tool_use``
for a request that gives tools, when there is one, else ``default``, as transformers chooses). ``tools`` and
``documents`` are always defined for the template (None when not given), as transformers defines them.
It runs in Jinja's ``ImmutableSandboxedEnvironment`` with the globals and filters transformers gives it
(``raise_exception``, ``strftime_now``, ``tojson``; ``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, a
pass-through ``{% generation %}`` block), so a template that works
with transformers renders the same text here, and neither a template nor a message can reach Python
objects beyond the data it is given. The text is tokenized without the tokenizer's own special tokens
(the template writes BOS where the checkpoint wants one), as transformers does.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from pdserve.model.model_dir import read_json, resolve_model_dir
from pdserve.model.tokenizer import load_hf_tokenizer

TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
RESERVED = ("messages", "add_generation_prompt", "tools", *SPECIAL_TOKENS)
"""The template variables :meth:`ChatTemplate.render` sets itself (its ``kwargs`` cannot)."""


class ChatTemplateError(ValueError):
    """The template refused a conversation (``raise_exception``) or failed while rendering it; the
    message says why (a client's mistake: answered as a bad request)."""


class _Generation(Extension):
    """``{% generation %}...{% endgeneration %}``: marks assistant text for training masks in
    transformers; rendering only needs its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _compile(source: str, origin: str) -> jinja2.Template:
    """``source`` compiled in the sandbox.

    Raises:
        ValueError: a syntax error, with its line.
    """
    try:
        return _environment().from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ValueError(f"chat template {origin}: line {exc.lineno}: {exc.message}") from None


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # not Jinja's own tojson, which escapes HTML characters: transformers renders JSON as json.dumps does
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _checkpoint_template(model_dir: Path, tok_cfg: dict) -> tuple[str, str, str | None] | None:
    """``(template, where it came from, its tool_use template or None)`` of the checkpoint, or None when it
    has none.

    Raises:
        ValueError: tokenizer_config.json lists named templates without a ``default`` one.
    """
    beside = model_dir / TEMPLATE_FILE
    if beside.is_file():
        return beside.read_text(encoding="utf-8"), str(beside), None
    found, tool_use = tok_cfg.get("chat_template"), None
    if isinstance(found, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in found if isinstance(t, dict)}
        if "default" not in named:
            raise ValueError(f"{model_dir / 'tokenizer_config.json'}: chat templates {sorted(map(str, named))} "
                             "include no 'default' one")
        found, tool_use = named["default"], named.get("tool_use")
    if isinstance(found, str) and found.strip():
        return found, str(model_dir / "tokenizer_config.json"), tool_use if isinstance(tool_use, str) else None
    return None


class ChatTemplate:
    """A compiled chat template with the checkpoint's special tokens and tokenizer.

    Use :meth:`load`; :meth:`render` then :meth:`encode` give a conversation's prompt ids.
    """

    def __init__(self, source: str, origin: str, model_dir: Path, special_tokens: dict[str, str],
                 tool_source: str | None = None) -> None:
        self.source, self.origin, self.special_tokens = source, origin, special_tokens
        self._template = _compile(source, origin)
        self._tool_template = _compile(tool_source, f"{origin} (tool_use)") if tool_source else self._template
        self._model_dir = model_dir
        self._tok: HFTokenizer | None = None

    @classmethod
    def load(cls, model_dir: str | Path, override_file: str | Path = "") -> ChatTemplate | None:
        """The template for ``model_dir`` (a checkpoint directory or hub repository id in the local
        cache): ``override_file`` when given, else the checkpoint's own; None when it has none.

        Raises:
            ValueError: ``override_file`` cannot be read, the template does not compile, or the
                checkpoint lists named templates without a default one.
            FileNotFoundError: the checkpoint cannot be found.
        """
        model_dir = resolve_model_dir(model_dir)
        tok_cfg = read_json(model_dir, "tokenizer_config.json") or {}
        if override_file:
            try:
                found: tuple[str, str, str | None] | None = (Path(override_file).read_text(encoding="utf-8"),
                                                             str(override_file), None)
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"chat template file {str(override_file)!r} cannot be read: {exc}") from None
        else:
            found = _checkpoint_template(model_dir, tok_cfg)
        if found is None:
            return None
        special = {name: text for name in SPECIAL_TOKENS if (text := _token_text(tok_cfg.get(name))) is not None}
        return cls(found[0], found[1], model_dir, special, found[2])

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
        """The prompt text of ``messages`` (dicts with ``role`` and ``content``, as OpenAI's API sends
        them; an assistant's ``tool_calls`` with their ``arguments`` as objects), ending with the assistant's
        turn opened when ``add_generation_prompt``. ``tools``: the functions the model may call (OpenAI's
        ``tools`` entries; not None: the checkpoint's ``tool_use`` template when it has one). ``kwargs`` are
        further template variables (not those in :data:`RESERVED`).

        Raises:
            ChatTemplateError: the template raised (``raise_exception``) or failed on these messages.
        """
        template = self._template if tools is None else self._tool_template
        kwargs = {"documents": None, **kwargs}
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                   **self.special_tokens, **kwargs)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused the conversation: {exc}") from None
        except Exception as exc:  # a template's own error on unexpected input (TypeError, ...): still the input's
            raise ChatTemplateError(f"the chat template failed on the conversation: {type(exc).__name__}: {exc}"
                                    ) from None

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered ``text``; special tokens in the text are recognised, none is added."""
        if self._tok is None:
            self._tok = load_hf_tokenizer(self._model_dir)
        return self._tok.encode(text, add_special_tokens=False).ids
