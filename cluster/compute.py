"""Where and in what a worker computes: its ``--device`` and ``--dtype`` settings, checked at config time
and resolved in the worker process (the machine asked is the one the worker runs on).

``auto`` device follows vLLM's default: the first CUDA GPU the process sees when torch has one (under Ray
each worker actor sees exactly the GPU it was given, as ``CUDA_VISIBLE_DEVICES`` says), else the CPU.
``auto`` dtype follows vLLM's ``--dtype auto`` (:func:`resolve_dtype`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pdserve.cluster.args import AUTO_DTYPE, DEVICE_AUTO, DTYPE_NAMES, check_device_name, check_dtype_name
from pdserve.kernels.cpu.gemv import packed_bf16_available


def resolve_device(name: str) -> torch.device:
    """The ``torch.device`` a worker with ``--device name`` computes on.

    Raises:
        ValueError: a malformed name (:func:`check_device_name`).
        RuntimeError: ``cuda`` or ``cuda:N`` where torch sees no CUDA GPU (a CPU build of torch, no driver)
            or fewer than ``N + 1`` of them; the message says which.
    """
    check_device_name(name)
    if name == DEVICE_AUTO:
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"--device {name}: torch sees no CUDA GPU here (torch {torch.__version__}, "
                               f"CUDA build: {torch.version.cuda or 'no'}); use --device cpu")
        index = 0 if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise RuntimeError(f"--device {name}: this process sees {torch.cuda.device_count()} CUDA GPU(s) "
                               "(CUDA_VISIBLE_DEVICES limits which)")
        device = torch.device("cuda", index)
    return device


def device_memory_bytes(device: torch.device) -> int | None:
    """Bytes still free on a CUDA ``device`` (``cudaMemGetInfo``); None for the CPU (whose memory
    :func:`model.kv_cache.available_memory_bytes` reads)."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def cpu_serves_bf16() -> bool:
    """Whether bf16 weights run on this CPU's packed bf16 kernels
    (:func:`kernels.cpu.gemv.packed_bf16_available`: AVX512-BF16, or the float32-FMA GEMM on any AVX-512
    CPU, or its AVX2 form elsewhere, given a C compiler). Elsewhere bf16 runs through torch's ``F.linear``,
    which on a CPU without AVX512-BF16 ran 4-9x slower than those kernels (`bench/cpu_kernels.py` on a
    Xeon model 207 that hides it)."""
    return packed_bf16_available()


def checkpoint_dtype(model_dir: str | Path) -> str:
    """The dtype a checkpoint's ``config.json`` stores its weights in (``torch_dtype``, or ``dtype`` as
    newer transformers write it; ``float32`` when absent, as transformers reads it).

    Raises:
        ValueError: the field names a dtype other than float32, bfloat16 or float16; the message names it.
    """
    path = Path(model_dir)
    if not path.is_dir():  # a hub repository id: its snapshot in the local cache
        from pdserve.model.model_dir import resolve_model_dir

        path = resolve_model_dir(model_dir)
    cfg = json.loads((path / "config.json").read_text())
    field_name = "torch_dtype" if "torch_dtype" in cfg else "dtype"
    stored = cfg.get(field_name) or "float32"
    if stored not in DTYPES:
        raise ValueError(f"{path / 'config.json'}: {field_name} {stored!r} is not one of {sorted(DTYPES)}; "
                         f"pass an explicit dtype (--dtype float32, bfloat16 or float16)")
    return stored


def resolve_dtype(dtype: str, model_dir: str | Path, device: torch.device | str = "cpu") -> str:
    """The dtype a worker serves in, with ``auto`` resolved (the only place it is).

    ``auto`` follows vLLM's ``--dtype auto``: the checkpoint's ``torch_dtype``, except that an fp32
    checkpoint is served in 16 bits: in bf16 on a CUDA ``device`` (as vLLM does on GPUs), and on a CPU in
    bf16 only where the packed bf16 kernels run (:func:`cpu_serves_bf16`: any AVX-512 or AVX2 CPU with a C
    compiler), else in float32. Resolve it in the worker process: the machine asked is the one the worker
    runs on. An explicit dtype is returned unchanged.

    Raises:
        ValueError: ``dtype`` is neither ``auto`` nor a known dtype, or (``auto``) as :func:`checkpoint_dtype`.
    """
    check_dtype_name(dtype)
    if dtype != AUTO_DTYPE:
        return dtype
    stored = checkpoint_dtype(model_dir)
    if stored == "float32":
        return "bfloat16" if torch.device(device).type == "cuda" or cpu_serves_bf16() else "float32"
    return stored
