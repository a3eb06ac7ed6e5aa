"""Structured output: sampling held to a grammar, by masking at each step the tokens the grammar does not allow
next, with xgrammar (Dong et al., "XGrammar", MLSys 2025), vLLM's default structured-output backend. The
kinds of grammar (:data:`~model.structured_spec.KINDS`, vLLM's ``structured_outputs``): any JSON object, JSON
matching a JSON Schema, text matching a regular expression (xgrammar's dialect), exactly one of a list of
strings, and a context-free grammar in xgrammar's EBNF (GBNF-like, start rule ``root``)::

    spec ("json_schema", schema text) ──Grammars.compile──► compiled grammar (cached per spec)
    compiled ──Constraint──► per request: mask(logits row) before sampling, accept(token) after

A grammar's end allows only the model's stop tokens (its EOS), so a constrained answer ends when its JSON is
complete. The grammar is compiled against the checkpoint's ``tokenizer.json`` as the serving path reads it
(added tokens included; xgrammar tells byte-level from SentencePiece byte-fallback vocabularies by it) over
the model's ``vocab_size`` logits. xgrammar and ``transformers`` are imported on first use (about 3 s), so a
worker that never sees a constrained request never loads them.

JSON Schemas compile without extra whitespace between tokens (xgrammar's ``any_whitespace=False``): a model
cannot pad its answer with spaces until ``max_tokens``; JSON objects (``json_object``) allow it as JSON does.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from pdserve.kernels.cpu import available
from pdserve.kernels.cpu.fused import mask_logits_
from pdserve.model.structured_spec import Spec, check_spec
from pdserve.model.tokenizer import load_hf_tokenizer

CACHE_SIZE = 64   # compiled grammars kept per process (least recently used dropped)


def choice_grammar(choices: Sequence[str]) -> str:
    """The EBNF of exactly one of ``choices``: each a string literal (JSON's escapes, which xgrammar's EBNF
    reads alike; other characters as they are)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _xgrammar_message(exc: RuntimeError) -> str:
    """xgrammar's error without its log prefix (``[time] file.cc:line: ``)."""
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(exc).strip().splitlines()[-1].strip())


class Grammars:
    """The grammars of one checkpoint: compiled on demand against its tokenizer, cached. Thread-safe.

    Args:
        model_dir: the checkpoint directory (its tokenizer files).
        vocab_size: the model's logits per row (may exceed the tokenizer's vocabulary).
        stop_token_ids: the tokens that end an answer (the model's EOS tokens).
    """

    def __init__(self, model_dir: str | Path, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self.model_dir, self.vocab_size, self.stop_token_ids = str(model_dir), vocab_size, list(stop_token_ids)
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._cache: OrderedDict[Spec, Any] = OrderedDict()

    def compile(self, spec: Spec) -> Any:
        """The compiled grammar of ``spec`` (cached).

        Raises:
            ValueError: a spec :func:`check_spec` refuses, or one xgrammar cannot compile (its message).
        """
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
            compiler = self._compiler = self._compiler or self._new_compiler()
            kind, text = spec
            check_spec(spec)
            try:
                if kind == "json_object":   # an object, as OpenAI's json_object (the builtin grammar takes arrays)
                    compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=True)
                elif kind == "json_schema":
                    compiled = compiler.compile_json_schema(text, any_whitespace=False)
                elif kind == "regex":
                    compiled = compiler.compile_regex(text)
                elif kind == "choice":
                    compiled = compiler.compile_grammar(choice_grammar(json.loads(text)))
                else:
                    compiled = compiler.compile_grammar(text)
            except RuntimeError as exc:   # xgrammar's error for a spec it cannot take
                what = "JSON schema" if kind == "json_schema" else kind
                raise ValueError(f"the {what} cannot be compiled: {_xgrammar_message(exc)}") from None
            self._cache[spec] = compiled
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return compiled

    def constraint(self, spec: Spec, prior: Sequence[int] = (), start_after: Sequence[int] = ()) -> Constraint:
        """A fresh :class:`Constraint` for one answer of ``spec``, past the answer's ``prior`` tokens (a
        migrated request's output so far, or the first token a prefill worker sampled); with ``start_after``, the
        grammar holds the answer only once it has written those tokens (:class:`Constraint`).

        Raises:
            ValueError: as :meth:`compile`, or a prior token the grammar does not allow.
        """
        return Constraint(self.compile(spec), self.vocab_size, prior, self.stop_token_ids, start_after)

    def _new_compiler(self) -> Any:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        # the checkpoint's tokenizer.json as the serving path reads it (added tokens included), not as
        # AutoTokenizer may rebuild it from a SentencePiece model
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=load_hf_tokenizer(Path(self.model_dir)))
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=self.stop_token_ids)
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)   # cached here, bounded


class Constraint:
    """One answer's place in its grammar: :meth:`mask` the logits of its next token, :meth:`accept` the token
    picked. Used by one thread at a time (a worker's engine thread).

    A grammar can reach a dead end, a place where no token is allowed (a schema whose strings can never
    match, e.g. a pattern nothing matches): the mask then allows the stop tokens alone, the answer ends there,
    and :attr:`dead_end` tells the worker to fail that request (not its batch).

    With ``start_after`` (a reasoning model's end of thinking, ``</think>``'s token ids), the answer is free
    until its output holds those tokens in a row, and held to the grammar from the token after them, as vLLM
    starts a grammar after the reasoning (its structured outputs' ``enable_in_reasoning`` off); :attr:`started`.
    """

    def __init__(self, compiled: Any, vocab_size: int, prior: Sequence[int] = (),
                 stop_token_ids: Sequence[int] = (), start_after: Sequence[int] = ()) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self._matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._stops = [t for t in stop_token_ids if 0 <= t < vocab_size]
        self._start_after = [int(t) for t in start_after]
        self._recent: list[int] = []    # the last len(start_after) tokens, until the grammar starts
        self.started = not self._start_after
        self.dead_end = False
        for token in prior:
            self.accept(token)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (``[vocab]``, any float dtype) as float32 with every token the grammar does not allow
        next at -inf (a copy); at a dead end, every token but the stop tokens; before the grammar has started,
        every token as it is."""
        out = logits.detach().float().reshape(-1).clone()
        if not self.started:
            return out
        if self._blocked():
            keep = out[self._stops].clone()
            out.fill_(-torch.inf)
            out[self._stops] = keep
            return out
        if out.device.type == "cpu" and available("fused"):   # one masked store per 16 tokens (kernels/cpu/fused.c)
            return mask_logits_(out, self._bitmask[0])
        self._xgr.apply_token_bitmask_inplace(out.unsqueeze(0), self._bitmask.to(out.device))
        return out

    def accept(self, token: int) -> None:
        """Move past ``token``; a stop token at a dead end ends the answer there (:attr:`dead_end`).

        Raises:
            ValueError: the grammar does not allow it here.
        """
        if not self.started:
            self._recent = [*self._recent, int(token)][-len(self._start_after):]
            self.started = self._recent == self._start_after
            return
        if self._matcher.accept_token(int(token)):
            return
        if int(token) in self._stops and self._blocked():
            self.dead_end = True
            return
        raise ValueError(f"token {token} is not allowed by the answer's grammar here")

    def _blocked(self) -> bool:
        """Fill the bitmask for the next token; whether it allows none."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        return not bool(self._bitmask.any())

    @property
    def done(self) -> bool:
        """Whether the answer has ended in its grammar (a stop token accepted, or a dead end)."""
        return self.dead_end or self.started and self._matcher.is_terminated()
