"""Weights in 2 MiB pages: fewer TLB misses while a decode step streams every weight.

A decode step reads every weight once, a few hundred MB in 4 KiB pages: one page walk
per 4 KiB. Backing the weights with transparent huge pages (``madvise(MADV_HUGEPAGE)``,
honoured when ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or
``madvise``) cuts that 512-fold; ``bench/cpu_kernels.py`` measures the packed bf16 gemv of
a bench-80m step both ways (docs/benchmarks.md).
Where the kernel refuses (not Linux, THP off) tensors stay in ordinary pages.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch
from torch import nn

HUGE_PAGE = 2 << 20
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    """Whether :func:`empty_huge` can get huge pages here: ``MADV_HUGEPAGE`` exists and transparent huge
    pages are ``always`` or ``madvise`` (the kernel may still fall back to 4 KiB pages for lack of
    contiguous memory; :func:`huge_page_bytes` tells what it did)."""
    try:
        mode = _THP.read_text()
    except OSError:
        return False
    return hasattr(mmap, "MADV_HUGEPAGE") and ("[always]" in mode or "[madvise]" in mode)


def huge_page_bytes(tensor: torch.Tensor) -> int:
    """Bytes in huge pages (``AnonHugePages`` of ``/proc/self/smaps``) of the mappings that hold
    ``tensor``'s storage: a mapping shared with other allocations counts whole. 0 where unknown."""
    return sum(_smaps_fields(tensor, "AnonHugePages:")) * 1024


def huge_page_eligible(tensor: torch.Tensor) -> bool:
    """Whether some mapping holding ``tensor``'s storage may be backed by huge pages (``THPeligible``
    of ``/proc/self/smaps``): what this module controls; whether the kernel then grants them
    depends on free contiguous memory at fault time (:func:`huge_page_bytes` tells)."""
    return any(_smaps_fields(tensor, "THPeligible:"))


def _smaps_fields(tensor: torch.Tensor, field: str) -> list[int]:
    """The integer ``field`` of every ``/proc/self/smaps`` mapping overlapping ``tensor``'s storage."""
    start = tensor.untyped_storage().data_ptr()
    end = start + tensor.untyped_storage().nbytes()
    out, inside = [], False
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):                    # "lo-hi perms ...": a new mapping
            lo, hi = (int(a, 16) for a in head.split("-"))
            inside = lo < end and start < hi
        elif inside and head == field:
            out.append(int(line.split()[1]))
    return out


def empty_huge(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled 1-D CPU tensor of ``numel`` elements in a fresh anonymous mapping whose whole
    2 MiB pages are advised huge before first touch (the unaligned head and tail stay in 4 KiB
    pages). A mapping of its own, not the allocator's: memory the process touched before (the
    allocator reuses it for large blocks once it has freed some) keeps its 4 KiB pages whatever
    the advice, so a long-lived worker's later allocations got none; the tensor keeps the mapping
    alive and it is unmapped with its last view."""
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)   # private: THP does not back shared memory
    raw = torch.frombuffer(buf, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    if nbytes >= HUGE_PAGE and huge_pages_available():
        buf.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE * HUGE_PAGE)
    return raw[start:start + nbytes].view(dtype)


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
