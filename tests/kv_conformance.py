"""Helpers of the KV transfer conformance suite (tests/test_kvtransfer_conformance*.py): the backends
this machine can run, sender/receiver pairs built by :mod:`kvtransfer.select` from the caches' devices,
and byte checks. Each test file turns :data:`BACKENDS` and :func:`pair_factory` into its ``backend``,
``make_pair`` and ``pair`` fixtures."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

from pdserve.kvtransfer.backends import SCHEMES, host_port
from pdserve.kvtransfer.base import KVReceiver
from pdserve.kvtransfer.cudaipc import CudaIpcKVReceiver, CudaIpcKVSender
from pdserve.kvtransfer.cudaipc.control import CacheShare
from pdserve.kvtransfer.cudaipc.handles import PeerCacheError, check_share
from pdserve.kvtransfer.select import SelectingKVSender, make_receiver, make_sender, nccl_status
from pdserve.kvtransfer.wire.frames import dtype_name
from pdserve.model.kv_cache import KVCacheSpec
from tests.kv_helpers import Outcome, make_spec

SRC, DST = [5, 1, 6], [2, 7, 0]  # source ids differ from destination ids on purpose
RECEIVER_CLASS = {"tcp": "TcpKVReceiver", "nccl": "NcclKVReceiver", "cuda-ipc": "CudaIpcKVReceiver"}


def _nccl_skip_reason() -> str | None:
    if torch.cuda.device_count() < 2:
        return f"NCCL KV transport needs 2 CUDA devices, this machine has {torch.cuda.device_count()}"
    return nccl_status()


BACKENDS = [pytest.param(("tcp", "cpu", "cpu"), id="tcp"),
            pytest.param(("cuda-ipc", "cpu", "cpu"), id="cuda-ipc-host"),
            pytest.param(("cuda-ipc", "cuda:0", "cuda:0"), id="cuda-ipc",
                         marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a CUDA GPU")),
            pytest.param(("nccl", "cuda:0", "cuda:1"), id="nccl",
                         marks=pytest.mark.skipif(_nccl_skip_reason() is not None, reason=str(_nccl_skip_reason())))]
"""(backend, sender device, receiver device). ``cuda-ipc`` on the CPU ("cuda-ipc-host") is the CUDA IPC
transport's protocol, checks and copies with the driver's two calls (export a cache, map a peer's) done by
:func:`host_export` / :func:`host_open` on CPU caches: everything but ``cudaIpcOpenMemHandle`` runs."""

_HOST_SHARES: dict[bytes, torch.Tensor] = {}


def host_export(cache: torch.Tensor) -> CacheShare:
    """Stand-in for :func:`kvtransfer.cudaipc.handles.export_cache` on a CPU cache (module doc)."""
    handle = uuid.uuid4().bytes
    _HOST_SHARES[handle] = cache
    return CacheShare("host", handle, cache.untyped_storage().nbytes(), 0, b"/torch_1_2", 0, b"", False,
                      cache.storage_offset(), cache.shape[0], dtype_name(cache.dtype), list(cache.shape[1:]))


def host_open(share: CacheShare, spec: KVCacheSpec) -> torch.Tensor:
    """Stand-in for :func:`kvtransfer.cudaipc.handles.open_peer_cache`: the same checks, then the CPU cache."""
    check_share(share, spec)
    if share.device_uuid != "host" or share.handle not in _HOST_SHARES:
        raise PeerCacheError(f"no shared cache {share.handle.hex()} on device {share.device_uuid}")
    return _HOST_SHARES[share.handle]


def random_cache(spec: KVCacheSpec, device: str, seed: int = 0) -> torch.Tensor:
    """Random bytes reinterpreted as the cache dtype: every bit pattern (NaNs included) must survive."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (*spec.shape[:-1], spec.head_dim * spec.dtype.itemsize), dtype=torch.uint8,
                        generator=g)
    return raw.view(spec.dtype).reshape(spec.shape).contiguous().to(device)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)


@dataclass
class Pair:
    backend: str
    spec: KVCacheSpec
    src: torch.Tensor
    dst: torch.Tensor
    rx: KVReceiver
    tx: object

    def expect(self, rid: str, blocks: list[int] = DST, timeout_s: float = 5.0) -> Outcome:
        out = Outcome()
        self.rx.expect(rid, blocks, timeout_s, out.on_complete, out.on_failed)
        return out

    def transfer(self, rid: str, token: int = 7, src: list[int] = SRC, dst: list[int] = DST):
        ch = self.tx.open(rid, self.rx.address)
        ch.send_pages((0, self.spec.num_layers), src, dst)
        return ch.finish(token)

    def address_for(self, hostport: str) -> str:
        return SCHEMES.get(self.backend, "") + hostport

    def hostport(self) -> tuple[str, int]:
        host, port = host_port(self.rx.address).rsplit(":", 1)
        return host, int(port)

    def close(self) -> None:
        self.tx.close()
        self.rx.close()


def pair_factory(backend: tuple[str, str, str]) -> Iterator[Callable[..., Pair]]:
    """Body of the ``make_pair`` fixture: yields a factory of sender/receiver pairs for ``backend``
    (name, sender device, receiver device), then closes every pair it made."""
    name, tx_device, rx_device = backend
    made: list[Pair] = []

    def make(dtype: torch.dtype = torch.float32, rx_io_timeout_s: float = 2.0, tx_io_timeout_s: float = 2.0,
             **kw: int) -> Pair:
        spec = make_spec(dtype, **kw)
        src, dst = random_cache(spec, tx_device), spec.allocate(rx_device)
        if name == "cuda-ipc" and tx_device == "cpu":
            rx = CudaIpcKVReceiver(dst, spec, io_timeout_s=rx_io_timeout_s, open_peer=host_open)
            tx = SelectingKVSender({name: CudaIpcKVSender(src, spec, 1.0, tx_io_timeout_s, export=host_export)})
        else:
            transport = "cuda-ipc" if name == "cuda-ipc" else "auto"
            rx = make_receiver(dst, spec, io_timeout_s=rx_io_timeout_s, transport=transport)
            tx = make_sender(src, spec, connect_timeout_s=1.0, io_timeout_s=tx_io_timeout_s, transport=transport)
        assert type(rx).__name__ == RECEIVER_CLASS[name] and tx.backends == (name,)
        made.append(Pair(name, spec, src, dst, rx, tx))
        return made[-1]

    yield make
    for p in made:
        p.close()


def assert_copied(p: Pair, src_ids: list[int], dst_ids: list[int], src_before: torch.Tensor) -> None:
    dst, src = as_bytes(p.dst), as_bytes(p.src)
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(dst[d], src[s]), f"block {s} -> {d} differs"
    untouched = [b for b in range(p.spec.num_blocks) if b not in dst_ids]
    assert not dst[untouched].any(), "bytes landed outside the destination blocks"
    assert torch.equal(src, as_bytes(src_before)), "the sender's cache changed"


def wait_for_pages(p: Pair, src_ids: list[int], dst_ids: list[int], layers: slice, timeout_s: float = 5.0) -> None:
    """Until those pages have landed: proof that the receiver has read the channel's first frame."""
    deadline = time.monotonic() + timeout_s
    want = as_bytes(p.src)[src_ids, layers]
    while not torch.equal(as_bytes(p.dst)[dst_ids, layers], want):
        assert time.monotonic() < deadline, "pages did not arrive"
        time.sleep(0.005)
