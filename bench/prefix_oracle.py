"""The prefix-cache oracle: the most prompt tokens any router could serve from cache.

The oracle is one cache of unlimited capacity that every request reaches, holding every block
that any worker could have cached before the request: all the full blocks of every earlier
prompt (earlier in the order the requests were sent). It uses the prefill workers' own rules
(:class:`pdserve.prefill_worker.prefix_cache.PrefixCache`):

- a cached block is a full, block-aligned run of ``block_size`` prompt tokens, identified
  by the whole prefix up to its end (a radix tree: equal blocks after different prefixes
  differ); a prompt of ``n`` tokens leaves ``n // block_size`` full blocks behind;
- a lookup reuses the longest cached block-aligned prefix, at most ``(n - 1) // block_size``
  blocks (the last prompt token is always computed).

Any real dispatch policy sends each request to one worker whose cache holds a subset of
those blocks (a worker only caches blocks of prompts it prefilled, and may evict), so it
matches at most the oracle's prefix: the sum of measured hits is at most the oracle's, as long
as each worker admits requests in the order they were sent (the router dispatches in arrival
order and a prefill worker's queue is FIFO). Comparing on the real prompt token ids (not
trace hash ids) and the workers' block size keeps sharing that crosses hash-block boundaries
(a prompt cut inside a shared hash block) inside the bound.

Exact (no hashing); ``tests/test_prefix_oracle.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class BlockTrie:
    """A radix tree of full ``block_size``-token blocks: an unbounded prefix cache.

    Args:
        block_size: tokens per block (the workers' ``block_size``).

    Raises:
        ValueError: ``block_size`` < 1.
    """

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._root: dict[tuple[int, ...], dict] = {}
        self.num_blocks = 0

    def _blocks(self, tokens: Sequence[int], n: int) -> Iterable[tuple[int, ...]]:
        bs = self.block_size
        return (tuple(tokens[i * bs:(i + 1) * bs]) for i in range(n))

    def match_blocks(self, tokens: Sequence[int]) -> int:
        """Blocks of the longest cached prefix of ``tokens``, at most ``(len - 1) // block_size``."""
        node, k = self._root, 0
        for block in self._blocks(tokens, max(0, (len(tokens) - 1) // self.block_size)):
            node = node.get(block)
            if node is None:
                break
            k += 1
        return k

    def insert(self, tokens: Sequence[int]) -> None:
        """Cache every full block of ``tokens`` (``len // block_size`` blocks)."""
        node = self._root
        for block in self._blocks(tokens, len(tokens) // self.block_size):
            child = node.get(block)
            if child is None:
                child = node[block] = {}
                self.num_blocks += 1
            node = child


def oracle_hits(prompts: Iterable[Sequence[int]], block_size: int) -> list[int]:
    """Per prompt (in the order sent), the prompt tokens the oracle serves from cache.

    Args:
        prompts: token ids of every prompt the workers saw, in the order they were sent
            (include warm-up requests: the workers cache them too).
        block_size: the workers' tokens per KV block.

    Returns:
        cached tokens per prompt, each a multiple of ``block_size`` and < the prompt's length.
    """
    trie, out = BlockTrie(block_size), []
    for tokens in prompts:
        out.append(trie.match_blocks(tokens) * block_size)
        trie.insert(tokens)
    return out


def send_order(records: Sequence[dict]) -> list[int]:
    """Indices of a replay's records in the order the client sent them: by scheduled arrival
    plus send delay (seconds), ties by trace index; a request never sent goes by its arrival."""
    def key(i: int) -> tuple[float, int]:
        r = records[i]
        return r["arrival_s"] + (r.get("send_delay_s") or 0.0), r["index"]
    return sorted(range(len(records)), key=key)


def sent_prompts(results: dict) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Every prompt a ``pdserve bench`` sweep sent, in order, rebuilt from its ``results.json``.

    Mirrors :mod:`pdserve.bench.replay.cli`: the warm-up prompts first, then per run (rate)
    its prompts in :func:`send_order`, the prompt text salted per rate unless ``same_prompts``.

    Returns:
        (prompts, keys): token ids, and per prompt ``(run index, record index)`` (``(-1, -1)``: warm-up).

    Raises:
        ValueError: a rebuilt prompt's length differs from the recorded ``prompt_tokens``
            (the results came from another trace, model or prompt builder).
    """
    from pdserve.bench.replay.prompts import PromptBuilder
    from pdserve.bench.replay.traces import TraceOptions, load_trace

    p = results["parameters"]
    out_scale = p["length_scale"] if p.get("output_scale") is None else p["output_scale"]
    trace = load_trace(p["trace"], None if p.get("format", "auto") == "auto" else p["format"], TraceOptions(
        max_requests=p["max_requests"], time_scale=p.get("time_scale", 1.0), length_scale=float(p["length_scale"]),
        output_scale=float(out_scale), min_prompt_tokens=p["min_prompt_tokens"],
        max_prompt_tokens=p["max_prompt_tokens"], min_output_tokens=p["min_output_tokens"],
        max_output_tokens=p["max_output_tokens"]))
    base = PromptBuilder(p["model"], seed=p["seed"])
    prompts: list[list[int]] = []
    keys: list[tuple[int, int]] = []
    for _ in range(p.get("warmup") or 0):
        prompts.append(base.bos + base.block("warmup", 16))
        keys.append((-1, -1))
    for k, run in enumerate(results["runs"]):
        builder = base if p.get("same_prompts") or k == 0 else PromptBuilder(p["model"], seed=f"{p['seed']}.r{k}")
        built = [builder.prompt(r, i, trace.block_tokens) for i, r in enumerate(trace.requests)]
        records = run["records"]
        if [len(x) for x in built] != [r["prompt_tokens"] for r in records]:
            raise ValueError(f"run {k}: rebuilt prompt lengths differ from the recorded ones")
        for i in send_order(records):
            prompts.append(built[records[i]["index"]])
            keys.append((k, i))
    return prompts, keys


def oracle_check(results: dict) -> dict:
    """The oracle against a ``pdserve bench`` sweep's measured prefix-cache hits (tokens).

    Returns:
        ``{"block_size", "prompt_tokens", "measured_tokens", "oracle_tokens", "within_oracle"
        (measured <= oracle), "requests_over_oracle" (requests whose own hit beats the oracle's
        for that request: 0 unless the workers admitted requests out of send order)}``; warm-up
        prompts feed the oracle's cache but are not counted.

    Raises:
        ValueError: the workers report different block sizes, or none (see also :func:`sent_prompts`).
    """
    sizes = {w["block_size"] for w in results.get("cluster", {}).get("workers", []) if w.get("role") != "decode"}
    if len(sizes) != 1:
        raise ValueError(f"need one prefill block size in results['cluster'], got {sorted(sizes)}")
    block_size = sizes.pop()
    prompts, keys = sent_prompts(results)
    hits = oracle_hits(prompts, block_size)
    measured = oracle = over = prompt = 0
    for (k, i), hit in zip(keys, hits):
        if k < 0:
            continue
        rec = results["runs"][k]["records"][i]
        prompt += rec["prompt_tokens"]
        measured += rec["cached_prompt_tokens"]
        oracle += hit
        over += rec["cached_prompt_tokens"] > hit
    return {"block_size": block_size, "prompt_tokens": prompt, "measured_tokens": measured, "oracle_tokens": oracle,
            "within_oracle": measured <= oracle, "requests_over_oracle": over}
