"""Prompt token ids of real English text for trace requests.

The pool is ``corpus.txt`` (self-written, story-like English in the style the embedded
TinyStories model knows) tokenized once with the model's own tokenizer. A prompt is
BOS (when the tokenizer adds one) followed by *blocks* of real-text tokens:

- a block is a deterministic function of ``(seed, key)``: two windows of the pool (one
  when a block has fewer than 4 tokens) at offsets drawn from ``random.Random(f"{seed}/{key}")``
  (string seeds hash with SHA-512, so the mapping is the same in every process);
  two windows make about ``len(pool) ** 2`` distinct blocks, so different keys give
  different blocks except with probability ~``1 / len(pool) ** 2`` per pair;
- Mooncake requests use their hash ids as keys: requests sharing a hash id share that
  block's tokens exactly, so the prefix cache can find shared prefixes;
- text past what the ids cover (rounding), and all of a prompt without ids (Azure), is
  unique to the request: 4 tokens from one pool offset then contiguous text from a second,
  both drawn from ``(seed, request index)``, so such prompts share no prefix beyond BOS
  (except with probability ~``1 / len(pool) ** 2`` per pair).
"""

from __future__ import annotations

import math
import random
from pathlib import Path

from pdserve.bench.replay.traces import TraceRequest
from pdserve.model.config import ModelConfig
from pdserve.model.tokenizer import Tokenizer

CORPUS = Path(__file__).with_name("corpus.txt")
DEFAULT_BLOCK_TOKENS = 16  # tokens per hash id when the caller gives none
UNIQUE_HEAD_TOKENS = 4  # a request's own text starts with this many tokens from a second place


class PromptBuilder:
    """Builds prompt token ids from a real-text token pool (see the module docstring).

    Args:
        model_dir: checkpoint directory whose tokenizer (and BOS id) to use.
        seed: selects the text; any value with a stable ``str`` (an int, or ``"0.r1"`` to salt a replay).
        corpus: a UTF-8 text file.

    Raises:
        ValueError: the corpus tokenizes to fewer than 64 tokens.
    """

    def __init__(self, model_dir: str | Path, seed: object = 0, corpus: str | Path = CORPUS) -> None:
        cfg = ModelConfig.from_hf_dir(model_dir)
        self.tokenizer = Tokenizer(model_dir, cfg.bos_token_id)
        ids = self.tokenizer.encode(Path(corpus).read_text(encoding="utf-8"))
        adds_bos = cfg.bos_token_id is not None and bool(ids) and ids[0] == cfg.bos_token_id
        self.bos: list[int] = [cfg.bos_token_id] if adds_bos else []
        self.pool: list[int] = ids[len(self.bos):]
        if len(self.pool) < 64:
            raise ValueError(f"corpus {corpus} has only {len(self.pool)} tokens")
        self.seed = seed

    def block(self, key: object, n: int) -> list[int]:
        """``n`` tokens of real text for block ``key`` (same seed and key: same tokens)."""
        o1, o2 = self._offsets(key)
        first = n // 2 if n >= 4 else n
        return self._window(o1, first) + self._window(o2, n - first)

    def prompt(self, req: TraceRequest, index: int, block_tokens: int | None = None) -> list[int]:
        """Token ids of request ``index`` of a trace: exactly ``req.prompt_tokens`` long.

        ``block_tokens`` is the tokens per hash id (the trace's scaled Mooncake block). Past
        the ids (all of an Azure prompt) the text is unique to the request: 4 tokens from one
        place of the pool, then contiguous text from another.
        """
        bs = block_tokens or DEFAULT_BLOCK_TOKENS
        out = list(self.bos)
        for h in req.block_ids or ():
            if len(out) >= req.prompt_tokens:
                break
            out += self.block(f"h{h}", bs)
        rest = req.prompt_tokens - len(out)
        if rest > 0:
            o1, o2 = self._offsets(f"r{index}")
            head = min(rest, UNIQUE_HEAD_TOKENS)
            out += self._window(o1, head) + self._window(o2, rest - head)
        return out[:req.prompt_tokens]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def _offsets(self, key: object) -> tuple[int, int]:
        rng = random.Random(f"{self.seed}/{key}")
        return rng.randrange(len(self.pool)), rng.randrange(len(self.pool))

    def _window(self, start: int, n: int) -> list[int]:
        """``n`` pool tokens from ``start``, wrapping around the end."""
        reps = math.ceil((start + n) / len(self.pool))
        return (self.pool * reps)[start:start + n] if reps > 1 else self.pool[start:start + n]
