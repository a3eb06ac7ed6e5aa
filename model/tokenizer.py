"""Tokenizer of a Hugging Face checkpoint (``tokenizer.json``, the ``tokenizers`` library)
and incremental detokenization for streaming text deltas."""

from __future__ import annotations

import functools
from collections.abc import Collection
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from pdserve.model.model_dir import read_json, resolve_model_dir


def load_hf_tokenizer(model_dir: Path) -> HFTokenizer:
    """The ``tokenizers`` tokenizer of ``model_dir/tokenizer.json``.

    Raises:
        FileNotFoundError: no ``tokenizer.json``.
        ValueError: it does not load (the message names the file and the parser's complaint).
    """
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (the checkpoint's tokenizer)")
    try:
        return HFTokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises bare Exceptions
        raise ValueError(f"{path}: not a tokenizer file `tokenizers` can load ({exc})") from None


class Tokenizer:
    """Encodes prompts (adding BOS as the checkpoint asks) and decodes token ids.

    ``model_dir``: a checkpoint directory or a hub repository id in the local cache
    (:func:`model.model_dir.resolve_model_dir`).

    Raises:
        FileNotFoundError: from the constructor when the checkpoint or its ``tokenizer.json`` is missing.
        ValueError: ``tokenizer.json`` or ``tokenizer_config.json`` cannot be read (the message names it).
    """

    def __init__(self, model_dir: str | Path, bos_token_id: int | None) -> None:
        model_dir = resolve_model_dir(model_dir)
        self._tok = load_hf_tokenizer(model_dir)
        tok_cfg = read_json(model_dir, "tokenizer_config.json") or {}
        # BOS as transformers adds it: when add_bos_token says so, else when the tokenizer has a BOS
        # token at all (Qwen's tokenizer_config sets bos_token to null: no BOS, whatever config.json says)
        has_bos = bos_token_id is not None and tok_cfg.get("bos_token", "") is not None
        self._add_bos = bool(tok_cfg.get("add_bos_token", has_bos)) and has_bos
        self.bos_token_id = bos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, starting with BOS when the checkpoint adds one (and ``add_special_tokens``:
        without it, none of the tokenizer's special tokens is added)."""
        if not add_special_tokens:
            return self._tok.encode(text, add_special_tokens=False).ids
        ids = self._tok.encode(text, add_special_tokens=True).ids
        if self._add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        """Text of ``ids`` with special tokens left out: those the tokenizer marks special, by id, as
        transformers leaves them out (``tokenizers`` alone matches them by their vocabulary string, which a
        normalized special token does not share with its content: the embedded model's EOS, ``▁<|end_story|>``
        in the vocabulary, came out as text at the end of every answer it ended). ``skip_special`` False keeps
        them."""
        if not skip_special:
            return self._tok.decode(ids, skip_special_tokens=False)
        special = self._special_ids
        return self._tok.decode([i for i in ids if i not in special] if special else ids, skip_special_tokens=True)

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def token_strs(self, ids: list[int]) -> list[str | None]:
        """Each id's token string in the vocabulary (None for an id it does not have)."""
        return [self._tok.id_to_token(i) for i in ids]

    @functools.cached_property
    def max_token_id(self) -> int:
        """The largest token id this tokenizer can produce, added tokens included (-1 for an empty vocabulary).
        A checkpoint whose tokenizer reaches past its model's ``vocab_size`` cannot serve text that tokenizes
        to those ids: the router warns at start and refuses such prompts by name."""
        return max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters of the longest token string in the vocabulary (added tokens included).

        Every token covers at most this many characters of a text (byte-level vocabularies map one
        byte to one character, and a text has no more characters than bytes), so a text longer than
        ``context * max_token_chars`` cannot fit the context: the router refuses it before tokenizing.
        """
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas.

    ``skip_special`` False keeps special tokens' text (:meth:`Tokenizer.decode`). The ids in ``drop`` (a
    request's stop tokens, which end it, so only its last token can be one) are left out of the text whatever
    they are, as vLLM leaves the stop token out unless ``include_stop_str_in_output``.
    Decodes a short window of ids before the new ones so that spacing rules that
    depend on the previous token (SentencePiece's leading ``▁``) come out right,
    and holds back a delta that ends in an incomplete UTF-8 sequence (U+FFFD),
    following vLLM's ``detokenize_incrementally``.
    """

    _CONTEXT = 5  # prompt tokens kept as left context

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special: bool = True,
                 drop: Collection[int] = ()) -> None:
        self._tok, self._skip, self._drop = tokenizer, skip_special, frozenset(drop)
        self._ids = list(prompt_ids[-self._CONTEXT:])
        self._prefix, self._read = 0, len(self._ids)

    def push(self, new_ids: list[int]) -> str:
        """Append output ids; return the text they complete (may be empty)."""
        self._ids.extend(new_ids)
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before):]

    def _decode(self, ids: list[int]) -> str:
        if self._drop:
            ids = [i for i in ids if i not in self._drop]
        return self._tok.decode(ids) if self._skip else self._tok.decode(ids, False)
