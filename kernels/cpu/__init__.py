"""C kernels for decode on x86 CPUs, compiled on first use and called through ctypes.

The CPU counterpart of the Triton kernels: the decode worker's hot loops that torch's
CPU operators run far from the machine's limits at decode shapes.

* :mod:`kernels.cpu.gemv` (``gemv_bf16.c``, ``gemm_bf16_fma.c``, ``gemm_bf16_avx2.c``): bf16 weight x
  activation products over pre-packed weights (on AVX512-BF16 ``vdpbf16ps``: a gemv and a
  register-blocked gemm; AMX tiles; float32 FMAs on any AVX-512 CPU, and on 8-lane AVX2 FMAs
  elsewhere), streaming each weight once per step;
* :mod:`kernels.cpu.attention` (``paged_attention.c``, ``prefill_attention*.c``): paged attention
  for decode and short query blocks, reading K/V through block tables without gathering them
  first, and causal flash-style attention of bf16 prefill chunks (on ``vdpbf16ps``, or on float32
  FMAs where the CPU lacks it or issues it slowly: ``prefill_attention_fma``; on 8-lane AVX2 FMAs
  without AVX-512: ``prefill_attention_avx2.c``);
* :mod:`kernels.cpu.fused` (``fused.c``): RMSNorm, RoPE with the KV cache write, and SiLU-and-mul,
  one call each instead of a dozen tensor operations;
* :mod:`kernels.cpu.decode_stack` (``decode_stack.c``): all decoder layers of a decode step in one
  call, through the kernels above.

Each source is compiled with the system C compiler (``cc``, else ``gcc``) into a shared
library cached under ``~/.cache/pdserve/kernels`` (``$XDG_CACHE_HOME`` respected), keyed
by source, flags, compiler and the CPU's feature flags, so a later process loads it at
once; the write is atomic, so worker processes starting together do not race. Where no
compiler or not the ISA a library needs is present, it reports itself unavailable and callers
keep the torch path: behaviour never depends on it, only speed.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_HERE = Path(__file__).resolve().parent
# per source: compiler flags. The gemv selects its ISA with target attributes and checks the
# CPU at run time. Never -ffast-math: linking with it sets flush-to-zero for the whole process.
# expf vectorizes through glibc's libmvec, declared "omp declare simd" in the sources.
_FLAGS = {
    "gemv_bf16": ["-O3"],
    "paged_attention": ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp-simd"],
    "fused": ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp-simd"],
    "gemv_int4": ["-O3"],
    "gemv_int4_avx2": ["-O3"],
    "gemm_bf16_fma": ["-O3"],
    "gemm_bf16_avx2": ["-O3"],
    "membw": ["-O2", "-pthread"],
    "decode_stack": ["-O3", "-march=native", "-ffp-contract=off"],
    "prefill_attention": ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp-simd"],
    "prefill_attention_fma": ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp-simd",
                              "-DPD_NO_DPBF16"],
    "prefill_attention_avx2": ["-O3", "-ffp-contract=off", "-fno-math-errno"],
    "prefill_attention_amx": ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno"],
}
_SOURCES = {"prefill_attention_fma": "prefill_attention"}   # libraries built from another's source


DTYPES = (torch.float32, torch.bfloat16)     # element types every CPU kernel takes


class KernelUnavailable(RuntimeError):
    """The C kernels cannot run here (no compiler, a failed build, or a CPU without the ISA)."""


class BuildFailedBefore(KernelUnavailable):
    """This build failed in an earlier process (its compiler output is recorded): logged once, at the failure."""


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdserve" / "kernels"


@functools.cache
def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


@functools.cache
def _compiler_version(cc: str) -> str:
    """``cc --version`` (part of every build's key), run once a process rather than once a library."""
    return subprocess.run([cc, "--version"], capture_output=True, text=True).stdout


def _compiler() -> str:
    for cc in ("cc", "gcc"):
        if shutil.which(cc):
            return cc
    raise KernelUnavailable("no C compiler (cc or gcc) on PATH")


def _private_dir(path: Path) -> None:
    """Create ``path`` (and parents) with owner-only permissions; tighten it if it is ours and open to others.

    Raises:
        OSError: it cannot be created, or it belongs to another user.
    """
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to uid {st.st_uid}, not to this user")
    if st.st_mode & 0o077:
        path.chmod(0o700)


def _trusted(lib: Path) -> bool:
    """Whether ``lib`` may be loaded as built: it exists, is a regular file owned by this user, and
    nobody else can write it (a library planted or swapped by another user is rebuilt instead)."""
    try:
        st = lib.lstat()
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


def _build(name: str) -> Path:
    """Compile ``name.c`` (or the source :data:`_SOURCES` names for it) into the cache (once per source,
    headers, flags, compiler and CPU) and return the library path.
    The cache directory is owner-only; a cached library that is not this user's own, or that others
    can write, is rebuilt rather than loaded. A build that failed is recorded beside it (``.failed``, the
    compiler's message) and not tried again for the same key: a CPU without the ISA of an AVX-512 build
    would otherwise pay a failing compile (~0.7 s) in every process that asks for it.

    Raises:
        KernelUnavailable: no compiler, an unwritable cache, or the build failed.
    """
    cc = _compiler()
    src = _HERE / f"{_SOURCES.get(name, name)}.c"
    source = src.read_bytes()
    headers = b"".join(h.read_bytes() for h in sorted(_HERE.glob("*.h")))    # what the sources #include
    flags = _FLAGS[name]
    version = _compiler_version(cc)
    key = hashlib.sha256(b"\0".join([source, headers, " ".join(flags).encode(), version.encode(),
                                     _cpu_flags().encode(), platform.machine().encode()])).hexdigest()[:16]
    out = _cache_dir() / f"{name}-{key}.so"
    failed = out.with_suffix(".failed")
    if _trusted(out):
        return out
    if _trusted(failed):
        raise BuildFailedBefore(f"building {name}.c failed before (the compiler's output: {failed}; delete it to "
                                f"retry)")
    try:
        _private_dir(out.parent)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    except OSError as exc:
        raise KernelUnavailable(f"cannot write the kernel cache {out.parent}: {exc}") from exc
    os.close(fd)
    try:
        compile_library(name, _HERE, Path(tmp))
    except KernelUnavailable as exc:
        Path(tmp).write_text(str(exc))
        os.replace(tmp, failed)                            # the same build fails the same way: not again
        raise
    os.replace(tmp, out)                                   # atomic: concurrent builders agree
    return out


def compile_library(name: str, source_dir: Path, out: Path) -> None:
    """Compile the library ``name`` from the sources in ``source_dir`` (``kernels/cpu`` or a copy of it
    at another commit, as ``bench/kernel_ab.py`` builds) into ``out`` with this project's flags for it.

    Raises:
        KernelUnavailable: no compiler, or the build failed.
    """
    src = source_dir / f"{_SOURCES.get(name, name)}.c"
    cmd = [_compiler(), *_FLAGS[name], "-shared", "-fPIC", str(src), "-o", str(out), "-lmvec", "-lm"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise KernelUnavailable(f"building {name}.c failed: {proc.stderr.strip()[-2000:]}")


@functools.cache
def library(name: str) -> ctypes.CDLL:
    """The loaded shared library of ``kernels/cpu/<name>.c``, built if needed.

    Raises:
        KernelUnavailable: it cannot be built or loaded here.
    """
    try:
        return ctypes.CDLL(str(_build(name)))
    except OSError as exc:
        raise KernelUnavailable(f"loading {name}: {exc}") from exc


PORTABLE_ENV = "PDSERVE_CPU_KERNELS"    # "torch": never use the C kernels (the path a CPU without AVX-512 takes)


@functools.cache
def available(name: str) -> bool:
    """Whether the kernel library ``name`` builds, loads and finds its ISA on this CPU; logs why not.

    A library that exports ``pd_cpu_supported()`` is asked whether this CPU has the ISA it needs.
    ``PDSERVE_CPU_KERNELS=torch`` in the environment makes every library unavailable, as on a CPU
    without AVX-512 (how the portable path is tested on a machine that has the ISA)."""
    try:
        if os.environ.get(PORTABLE_ENV, "").lower() == "torch":
            raise KernelUnavailable(f"{PORTABLE_ENV}=torch")
        lib = library(name)
        supported = getattr(lib, "pd_cpu_supported", None)
        if supported is not None and not supported():       # expected: another build serves this CPU
            log.info("CPU kernel %s not used: this CPU lacks the ISA it needs", name)
            return False
        return True
    except KernelUnavailable as exc:
        log.log(logging.INFO if isinstance(exc, BuildFailedBefore) else logging.WARNING,
                "CPU kernel %s unavailable, using torch: %s", name, exc)
        return False
