"""A thin ctypes binding of the NCCL calls the KV transport needs, loaded from the ``nvidia-nccl-cu12`` wheel.

Only point-to-point traffic is bound: version, unique id, communicator init (non-blocking,
so a peer that never joins can be given up on), ``ncclSend``/``ncclRecv`` inside
``ncclGroupStart``/``ncclGroupEnd``, async error polling, abort and destroy. Signatures follow
``nccl.h`` of NCCL 2.32 (shipped in the wheel under ``nvidia/nccl/include``); the calls used here
have kept their ABI since NCCL 2.14. vLLM's ``pynccl_wrapper.py`` binds NCCL the same way
(ctypes over the wheel's ``libnccl.so.2``); this one is written from the header.

Loading the library and the host-only calls (:meth:`NcclLibrary.version`,
:meth:`NcclLibrary.get_unique_id`) work without a GPU: ``ncclGetUniqueId`` starts NCCL's
bootstrap root (a listening socket on the interface chosen by ``NCCL_SOCKET_IFNAME``) and returns
its address inside the 128-byte id. Creating a communicator needs a CUDA driver and device; without
one NCCL 2.32 fails with ``ncclUnhandledCudaError`` ("CUDA driver version is insufficient for CUDA
runtime version"), raised here as :class:`NcclError`.
"""

from __future__ import annotations

import ctypes
import importlib.util
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES
_SONAME = "libnccl.so.2"
_NCCL_API_MAGIC = 0xCAFEBEEF
_CONFIG_VERSION = 21400  # layout of ncclConfig_t up to ``netName`` (NCCL 2.14); later fields keep their defaults
_UNDEF_INT = -(2 ** 31)  # NCCL_CONFIG_UNDEF_INT

# ncclResult_t
SUCCESS, IN_PROGRESS = 0, 7
RESULT_NAMES = {0: "ncclSuccess", 1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError",
                4: "ncclInvalidArgument", 5: "ncclInvalidUsage", 6: "ncclRemoteError", 7: "ncclInProgress",
                8: "ncclTimeout"}
_UINT8 = 1  # ncclDataType_t ncclUint8: pages move as raw bytes, whatever the cache dtype


class NcclUnavailable(RuntimeError):
    """``libnccl.so.2`` cannot be found or loaded; the message lists every place tried and why it failed."""


class NcclError(RuntimeError):
    """An NCCL call returned an error.

    Attributes:
        code: the ``ncclResult_t`` value (see :data:`RESULT_NAMES`).
        call: the NCCL function that failed.
    """

    def __init__(self, call: str, code: int, detail: str) -> None:
        name = RESULT_NAMES.get(code, f"ncclResult {code}")
        super().__init__(f"{call} failed: {name}: {detail}")
        self.code, self.call = code, call


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_ubyte * UNIQUE_ID_BYTES)]


class _Config(ctypes.Structure):
    """The leading fields of ``ncclConfig_t``; ``size`` and ``version`` tell NCCL how much of it we set."""

    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint), ("version", ctypes.c_uint),
                ("blocking", ctypes.c_int), ("cgaClusterSize", ctypes.c_int), ("minCTAs", ctypes.c_int),
                ("maxCTAs", ctypes.c_int), ("netName", ctypes.c_char_p)]


_c, _p, _i, _sz = ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
_SIGNATURES: dict[str, tuple[type | None, list]] = {
    "ncclGetVersion": (_c, [ctypes.POINTER(_i)]),
    "ncclGetUniqueId": (_c, [ctypes.POINTER(_UniqueId)]),
    "ncclCommInitRankConfig": (_c, [ctypes.POINTER(_p), _i, _UniqueId, _i, ctypes.POINTER(_Config)]),
    "ncclCommGetAsyncError": (_c, [_p, ctypes.POINTER(_c)]),
    "ncclCommAbort": (_c, [_p]),
    "ncclCommDestroy": (_c, [_p]),
    "ncclGroupStart": (_c, []),
    "ncclGroupEnd": (_c, []),
    "ncclSend": (_c, [_p, _sz, _c, _i, _p, _p]),
    "ncclRecv": (_c, [_p, _sz, _c, _i, _p, _p]),
    "ncclGetErrorString": (ctypes.c_char_p, [_c]),
    "ncclGetLastError": (ctypes.c_char_p, [_p]),
}


def candidate_paths() -> list[str]:
    """Where :func:`load_library` looks, in order: the ``nvidia-nccl-cu12`` wheel's ``nvidia/nccl/lib``
    directory (found through the ``nvidia.nccl`` namespace package), then the bare soname for the
    system loader (``LD_LIBRARY_PATH``, ldconfig cache)."""
    paths = []
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        spec = None
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        paths.append(str(Path(root) / "lib" / _SONAME))
    paths.append(_SONAME)
    return paths


@dataclass(frozen=True)
class Version:
    """An NCCL version; ``code`` is ``NCCL_VERSION_CODE`` (``major * 10000 + minor * 100 + patch`` since 2.9)."""

    code: int

    @property
    def parts(self) -> tuple[int, int, int]:
        """(major, minor, patch)."""
        return self.code // 10000, self.code // 100 % 100, self.code % 100

    def __str__(self) -> str:
        return "%d.%d.%d" % self.parts


class NcclLibrary:
    """One loaded ``libnccl.so.2`` with typed entry points. Thread-safe as NCCL is: calls on one
    communicator must come from one thread at a time (the KV transport holds a lock per pair).

    Args:
        path: file to load; None searches :func:`candidate_paths`.
    Raises:
        NcclUnavailable: no candidate loads, or one lacks a needed symbol (too old an NCCL).
    """

    def __init__(self, path: str | None = None) -> None:
        tried = []
        for candidate in [path] if path is not None else candidate_paths():
            try:
                lib = ctypes.CDLL(candidate)
            except OSError as e:
                tried.append(f"{candidate}: {e}")
                continue
            missing = [name for name in _SIGNATURES if not hasattr(lib, name)]
            if missing:
                tried.append(f"{candidate}: missing symbols {missing} (NCCL older than 2.14?)")
                continue
            self.path = candidate
            self._lib = lib
            for name, (restype, argtypes) in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = restype, argtypes
            return
        raise NcclUnavailable("cannot load the NCCL library (pip install nvidia-nccl-cu12 on Linux x86_64); tried: "
                              + "; ".join(tried))

    # -- host-only calls (no GPU needed) ---------------------------------------------------------

    def version(self) -> Version:
        """The loaded library's version (``ncclGetVersion``)."""
        code = ctypes.c_int()
        self._check("ncclGetVersion", self._lib.ncclGetVersion(ctypes.byref(code)))
        return Version(code.value)

    def get_unique_id(self) -> bytes:
        """A fresh ``ncclUniqueId`` (128 bytes) naming a new communicator; its creator must be rank 0.

        Starts NCCL's bootstrap root in this process, which waits for the ranks to join.
        Raises:
            NcclError: e.g. no usable network interface for the bootstrap socket.
        """
        uid = _UniqueId()
        self._check("ncclGetUniqueId", self._lib.ncclGetUniqueId(ctypes.byref(uid)))
        return bytes(uid.internal)

    def error_string(self, code: int) -> str:
        """NCCL's text for a ``ncclResult_t``."""
        return (self._lib.ncclGetErrorString(code) or b"").decode(errors="replace")

    # -- communicators ---------------------------------------------------------------------------

    def comm_init_rank(self, num_ranks: int, unique_id: bytes, rank: int, timeout_s: float) -> int:
        """Join the communicator named by ``unique_id`` as ``rank`` of ``num_ranks`` on the current CUDA
        device; returns the ``ncclComm_t`` handle. Non-blocking init polled until ready, so a peer that
        never joins costs at most ``timeout_s`` (the half-built communicator is then aborted).

        Raises:
            ValueError: ``unique_id`` is not 128 bytes.
            NcclError: init failed (no CUDA device or driver, network, peer mismatch) or timed out
                (``code`` 8, ncclTimeout).
        """
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id is {UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
        uid = _UniqueId()
        ctypes.memmove(uid.internal, unique_id, UNIQUE_ID_BYTES)
        config = _Config(ctypes.sizeof(_Config), _NCCL_API_MAGIC, _CONFIG_VERSION, 0, _UNDEF_INT, _UNDEF_INT,
                         _UNDEF_INT, None)
        comm = ctypes.c_void_p()
        result = self._lib.ncclCommInitRankConfig(ctypes.byref(comm), num_ranks, uid, rank, ctypes.byref(config))
        if result not in (SUCCESS, IN_PROGRESS):
            if comm.value:
                self._lib.ncclCommAbort(comm)
            self._check("ncclCommInitRankConfig", result)
        try:
            self.wait_ready(comm.value, time.monotonic() + timeout_s, "ncclCommInitRankConfig")
        except NcclError:
            self.comm_abort(comm.value)
            raise
        return comm.value

    def async_error(self, comm: int) -> int:
        """``ncclCommGetAsyncError``: ncclSuccess, ncclInProgress (a non-blocking call still running) or an error."""
        state = ctypes.c_int()
        self._check("ncclCommGetAsyncError", self._lib.ncclCommGetAsyncError(comm, ctypes.byref(state)), comm)
        return state.value

    def wait_ready(self, comm: int, deadline: float, call: str, is_done: Callable[[], bool] | None = None) -> None:
        """Poll ``comm`` until it leaves ncclInProgress and, with ``is_done``, until ``is_done()`` is true
        (e.g. a CUDA event query), checking for async errors. ``deadline`` is ``time.monotonic()`` seconds.

        Raises:
            NcclError: an async error on ``comm``, or the deadline passed (ncclTimeout).
        """
        pause = 1e-5
        while True:
            state = self.async_error(comm)
            if state not in (SUCCESS, IN_PROGRESS):
                self._check(call, state, comm)
            if state == SUCCESS and (is_done is None or is_done()):
                return
            if time.monotonic() >= deadline:
                raise NcclError(call, 8, "timed out waiting for the peer")
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)

    def comm_abort(self, comm: int) -> None:
        """``ncclCommAbort``: stop outstanding work and free the communicator (use after a failure). Never raises."""
        self._lib.ncclCommAbort(comm)

    def comm_destroy(self, comm: int) -> None:
        """``ncclCommDestroy``: free a healthy communicator after its work finished. Never raises."""
        self._lib.ncclCommDestroy(comm)

    # -- point to point ----------------------------------------------------------------------------

    def send_recv_group(self, comm: int, stream: int, peer: int, buffers: list[tuple[int, int]], send: bool) -> None:
        """Enqueue one ``ncclSend`` (``send``) or ``ncclRecv`` per ``(device pointer, nbytes)`` buffer to/from
        ``peer`` on ``stream`` (a ``cudaStream_t``), fused in one group so they progress together.
        Returns once enqueued; completion is the stream's (record an event and poll it).

        Raises:
            NcclError: an enqueue failed (the group is closed first).
        """
        fn, name = (self._lib.ncclSend, "ncclSend") if send else (self._lib.ncclRecv, "ncclRecv")
        self._check("ncclGroupStart", self._lib.ncclGroupStart())
        try:
            for ptr, nbytes in buffers:
                self._check(name, fn(ptr, nbytes, _UINT8, peer, comm, stream), comm)
        finally:
            end = self._lib.ncclGroupEnd()
        if end not in (SUCCESS, IN_PROGRESS):
            self._check("ncclGroupEnd", end, comm)

    def _check(self, call: str, result: int, comm: int | None = None) -> None:
        if result in (SUCCESS, IN_PROGRESS):
            return
        last = (self._lib.ncclGetLastError(comm) or b"").decode(errors="replace")
        raise NcclError(call, result, f"{self.error_string(result)}" + (f" ({last})" if last else ""))


_loaded: dict[str | None, NcclLibrary] = {}
_load_lock = threading.Lock()


def load_library(path: str | None = None) -> NcclLibrary:
    """The process-wide :class:`NcclLibrary` for ``path`` (None: search), loaded once.

    Raises:
        NcclUnavailable: see :class:`NcclLibrary`.
    """
    with _load_lock:
        if path not in _loaded:
            _loaded[path] = NcclLibrary(path)
        return _loaded[path]
