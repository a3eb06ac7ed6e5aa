"""Where a checkpoint lives and how its tensors are read: the one place that turns a ``--model``
argument into a directory, used by the config reader, the loader and the tokenizer.

A model argument is either a checkpoint directory or a Hugging Face hub repository id
(``Qwen/Qwen2.5-0.5B-Instruct``) resolved in the *local* hub cache, never downloaded::

    $HF_HUB_CACHE/models--Qwen--Qwen2.5-0.5B-Instruct/
        refs/main                 -> commit hash
        snapshots/<hash>/         config.json, tokenizer.json, model*.safetensors, ...

The cache is the one ``huggingface_hub`` uses (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
``~/.cache/huggingface/hub``), read when a model is resolved, so a process started with another
cache sees it. Weights are one ``model.safetensors``, any set of ``*.safetensors`` files, or shards
listed by ``model.safetensors.index.json`` (then exactly the files and tensors it names); they are
read one tensor at a time (:func:`iter_tensors`) so that a loader never holds the checkpoint twice.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")   # owner/name, as the hub spells repository ids


def hub_cache_dir() -> Path:
    """The local Hugging Face hub cache, by ``huggingface_hub``'s rules, read now (not at import)."""
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                               "huggingface")
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(os.path.expanduser(cache))


def looks_like_repo_id(model: str) -> bool:
    """Whether ``model`` has the form of a hub repository id (``owner/name``)."""
    return bool(_REPO_ID.match(model)) and ".." not in model


def resolve_model_dir(model: str | Path) -> Path:
    """The checkpoint directory ``model`` names: an existing directory as given, else the snapshot
    of hub repository ``model`` in the local cache (no network access).

    Raises:
        FileNotFoundError: neither a directory nor a repository in the local cache; the message
            names the cache directory and the folder looked for.
    """
    path = Path(model)
    if path.is_dir():
        return path
    text = str(model)
    if not looks_like_repo_id(text):
        raise FileNotFoundError(f"{text}: no such checkpoint directory (nor a hub repository id owner/name)")
    cache = hub_cache_dir()
    from huggingface_hub import snapshot_download  # a transformers dependency; only hub ids need it

    try:
        return Path(snapshot_download(text, cache_dir=str(cache), local_files_only=True))
    except (OSError, ValueError) as exc:  # LocalEntryNotFoundError is both; a bad id is a ValueError
        folder = cache / ("models--" + text.replace("/", "--")) / "snapshots"
        raise FileNotFoundError(
            f"{text}: not a checkpoint directory, and hub repository {text!r} is not in the local Hugging Face "
            f"cache (looked in {folder}; cache {cache}, set by HF_HUB_CACHE or HF_HOME). pdserve never downloads: "
            f"fetch it first (`hf download {text}`) or pass a directory. ({type(exc).__name__})") from None


def model_reference(model: str | Path) -> str:
    """What to hand to processes for ``model``: an existing directory as an absolute path, a hub
    repository id unchanged (each process resolves it in its own cache) once it resolves here.

    Raises:
        FileNotFoundError: as :func:`resolve_model_dir`.
    """
    if Path(model).is_dir():
        return str(Path(model).resolve())
    resolve_model_dir(model)
    return str(model)


def _index_map(model_dir: Path) -> dict[str, str] | None:
    index = read_json(model_dir, INDEX_FILE)
    if index is None:
        return None
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{model_dir / INDEX_FILE}: no weight_map (tensor name -> shard file)")
    bad = [f"{k}: {v!r}" for k, v in weight_map.items() if not isinstance(v, str)]
    if bad:
        raise ValueError(f"{model_dir / INDEX_FILE}: weight_map values must be shard file names, got {bad[:4]}")
    return weight_map


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The weight files of a checkpoint directory: the shards ``model.safetensors.index.json``
    names, else every ``*.safetensors`` file, sorted.

    Raises:
        FileNotFoundError: no weight file, or a shard the index names is absent.
        ValueError: an index without a weight map.
    """
    model_dir = Path(model_dir)
    weight_map = _index_map(model_dir)
    if weight_map is None:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
        return files
    names = sorted(set(weight_map.values()))
    missing = [n for n in names if not (model_dir / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{model_dir / INDEX_FILE} names shards that are not there: {missing}")
    return [model_dir / n for n in names]


def iter_tensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor of the checkpoint, read one at a time in file order (the
    caller casts or places each before the next is read); tensors keep their stored dtype.

    Raises:
        FileNotFoundError: as :func:`safetensors_files`.
        ValueError: a file that is not readable safetensors (named), a name in two files, or (sharded)
            a tensor in another shard than the index says, or one the index lists that no shard holds.
    """
    model_dir = Path(model_dir)
    weight_map = _index_map(model_dir)
    seen: set[str] = set()
    for path in safetensors_files(model_dir):
        with open_safetensors(path) as f:
            for name in f.keys():
                if name in seen:
                    raise ValueError(f"{model_dir}: tensor {name} appears in more than one file")
                if weight_map is not None and weight_map.get(name) != path.name:
                    raise ValueError(f"{path}: holds {name}, which {INDEX_FILE} places in {weight_map.get(name)!r}")
                seen.add(name)
                yield name, f.get_tensor(name)
    if weight_map is not None and weight_map.keys() - seen:
        raise ValueError(f"{model_dir / INDEX_FILE}: lists tensors no shard holds: {sorted(weight_map.keys() - seen)}")


_PROJECTION = re.compile(r"\.layers\.\d+\..*_proj\.weight$")   # a decoder layer's linear weight


def weights_nbytes(model_dir: str | Path, dtype: torch.dtype, projection_bytes: float | None = None) -> int:
    """Bytes the weights of a checkpoint (a directory or a hub repository id in the local cache,
    :func:`resolve_model_dir`) take at least once loaded, read from the safetensors headers alone
    (nothing is loaded): floating tensors at ``dtype``'s element size, except the decoder layers'
    2-D ``*_proj.weight`` at ``projection_bytes`` a parameter where the worker quantizes them (0.5 for
    INT4, 1 for FP8; their scales not counted); integer tensors (a pre-quantized checkpoint's packed
    weights) at their stored size. A lower bound: the packed layouts the CPU kernels add, and a
    loader's transient copies, come on top.

    Raises:
        FileNotFoundError, ValueError: as :func:`resolve_model_dir`, :func:`safetensors_files` and
            :func:`open_safetensors`.
    """
    size = torch.empty((), dtype=dtype).element_size()
    total = 0.0
    for path in safetensors_files(resolve_model_dir(model_dir)):
        with open_safetensors(path) as f:
            for name in f.keys():
                piece = f.get_slice(name)
                numel = math.prod(piece.get_shape())
                stored = _SAFETENSORS_DTYPES.get(piece.get_dtype())
                if stored is None or not stored.is_floating_point:
                    total += numel * (stored.itemsize if stored is not None else 1)
                elif projection_bytes is not None and len(piece.get_shape()) == 2 and _PROJECTION.search(name):
                    total += numel * projection_bytes
                else:
                    total += numel * size
    return int(total)


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                       "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


def open_safetensors(path: Path):
    """``safe_open(path)``.

    Raises:
        ValueError: ``path`` is not a readable safetensors file (truncated, not safetensors, a directory);
            the message names it.
    """
    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError: all mean an unreadable shard
        raise ValueError(f"{path}: not a readable safetensors file ({type(exc).__name__}: {exc})") from None


def read_json(model_dir: str | Path, name: str) -> dict | None:
    """``name`` (e.g. ``generation_config.json``) of the checkpoint as a dict, or ``None`` when absent.

    Raises:
        ValueError: the file is not UTF-8 JSON holding an object (the message names the file).
    """
    path = Path(model_dir) / name
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, IsADirectoryError) as exc:
        raise ValueError(f"{path}: not a JSON file ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: holds a JSON {type(data).__name__}, not an object")
    return data
