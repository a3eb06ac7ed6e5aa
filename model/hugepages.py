"""Weights in 2 MiB pages: fewer TLB misses while a decode step streams every weight.

A decode step reads every weight once, a few hundred MB in 4 KiB pages: one page walk
per 4 KiB. Backing the weights with transparent huge pages (``madvise(MADV_HUGEPAGE)``,
honoured when ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or
``madvise``) cuts that 512-fold; ``bench/cpu_kernels.py`` measures the packed bf16 gemv of
a bench-80m step both ways (docs/benchmarks.md).
Where the kernel refuses (not Linux, THP off) tensors stay in ordinary pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from pathlib import Path

import torch
from torch import nn

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def _madvise():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def huge_pages_available() -> bool:
    """Whether :func:`empty_huge` can get huge pages here: ``madvise`` is callable and transparent huge
    pages are ``always`` or ``madvise`` (the kernel may still fall back to 4 KiB pages for lack of
    contiguous memory; :func:`huge_page_bytes` tells what it did)."""
    try:
        mode = _THP.read_text()
    except OSError:
        return False
    return _madvise() is not None and ("[always]" in mode or "[madvise]" in mode)


def huge_page_bytes(tensor: torch.Tensor) -> int:
    """Bytes in huge pages (``AnonHugePages`` of ``/proc/self/smaps``) of the mappings that hold
    ``tensor``'s storage: a mapping shared with other allocations counts whole. 0 where unknown."""
    start = tensor.untyped_storage().data_ptr()
    end = start + tensor.untyped_storage().nbytes()
    total, inside = 0, False
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):                    # "lo-hi perms ...": a new mapping
            lo, hi = (int(a, 16) for a in head.split("-"))
            inside = lo < end and start < hi
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return total


def empty_huge(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor of ``numel`` elements whose whole 2 MiB pages are advised
    huge before first touch (the unaligned head and tail stay in 4 KiB pages)."""
    item = torch.empty(0, dtype=dtype).element_size()
    raw = torch.empty(numel * item + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    madvise = _madvise()
    if madvise is not None and numel * item >= HUGE_PAGE:
        madvise(raw.data_ptr() + start, numel * item // HUGE_PAGE * HUGE_PAGE, _MADV_HUGEPAGE)
    return raw[start:start + numel * item].view(dtype)


def move_to_huge_pages(module: nn.Module) -> int:
    """Copy every CPU parameter and buffer of ``module`` into one huge-page arena per dtype,
    in place (tied tensors stay tied). Returns the bytes moved."""
    tensors: dict[int, torch.Tensor] = {}
    for t in [*module.parameters(), *module.buffers()]:
        if t.device.type == "cpu" and t.numel() and t.is_contiguous():
            tensors.setdefault(t.data_ptr(), t)
    moved = 0
    for dtype in {t.dtype for t in tensors.values()}:
        group = [t for t in tensors.values() if t.dtype == dtype]
        for t, copy in zip(group, copies_in_huge_pages([t.data for t in group])):
            t.data = copy
            moved += t.numel() * t.element_size()
    return moved


def copies_in_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` (CPU, one dtype) side by side in one huge-page arena, each slot
    64-byte aligned."""
    item = tensors[0].element_size()
    arena = empty_huge(sum(_padded(t.numel(), item) for t in tensors), tensors[0].dtype)
    out, offset = [], 0
    for t in tensors:
        out.append(arena[offset:offset + t.numel()].view(t.shape).copy_(t))
        offset += _padded(t.numel(), item)
    return out


def _padded(numel: int, item: int) -> int:
    """Elements of a 64-byte aligned slot for ``numel`` elements of ``item`` bytes."""
    per_line = max(1, 64 // item)
    return -(-numel // per_line) * per_line
