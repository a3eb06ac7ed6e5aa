"""Where a checkpoint lives: the one place that turns a ``--model`` argument into a directory, and its JSON
files, for the config reader, the tokenizer, the chat template and the loader (:mod:`model.checkpoint` reads
the tensors). Without torch, so that a router resolves and reads a checkpoint without importing it.

A model argument is either a checkpoint directory or a Hugging Face hub repository id
(``Qwen/Qwen2.5-0.5B-Instruct``) resolved in the *local* hub cache, never downloaded::

    $HF_HUB_CACHE/models--Qwen--Qwen2.5-0.5B-Instruct/
        refs/main                 -> commit hash
        snapshots/<hash>/         config.json, tokenizer.json, model*.safetensors, ...

The cache is the one ``huggingface_hub`` uses (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
``~/.cache/huggingface/hub``), read when a model is resolved, so a process started with another
cache sees it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

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
