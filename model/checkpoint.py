"""How a checkpoint's tensors are read (where it lives: :mod:`model.model_dir`). Weights are one
``model.safetensors``, any set of ``*.safetensors`` files, or shards listed by ``model.safetensors.index.json``
(then exactly the files and tensors it names); they are read one tensor at a time (:func:`iter_tensors`) so
that a loader never holds the checkpoint twice.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.model.model_dir import read_json, resolve_model_dir

INDEX_FILE = "model.safetensors.index.json"


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
