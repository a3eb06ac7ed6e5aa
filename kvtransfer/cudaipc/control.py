"""Control channel of the CUDA IPC KV transport: the frames of :mod:`kvtransfer.wire.frames` plus two of its own.

Same wire shape and authentication as the TCP transport; no page bytes cross the socket. One
connection per request::

    sender (prefill P)                                              receiver (decode D)
    ipc_hello{request_id, sender_id, device_uuid, handle, storage_nbytes, storage_offset,
              ref_counter, ref_counter_offset, event_handle, event_sync,
              tensor_offset, num_blocks, dtype, page_shape}  ──►  map P's cache (once per sender,
                                                                   :class:`~.handles.PeerCaches`)
    ipc_pages{request_id, layer_start, layer_end,
              src_block_ids, dst_block_ids}  ──►  cache[dst, l0:l1] = P's cache[src, l0:l1] (device copy,
                                                   finished before the next frame is read)
    done / abort  ──►                    ◄──  ack, as in the TCP transport (ack{ok=False} and close on a refusal)

The hello's sharing fields are those of ``torch.UntypedStorage._share_cuda_`` (what
``torch.multiprocessing`` pickles for a CUDA tensor), sent as typed msgpack fields instead of a pickle.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.kvtransfer.backends import SCHEMES
from pdserve.kvtransfer.wire.control import ControlCodec

SCHEME = SCHEMES["cuda-ipc"]
"""Prefix of a CUDA IPC receiver's address: ``cuda-ipc://host:port``."""


@dataclass(frozen=True)
class CacheShare:
    """How another process maps one CUDA KV cache (the fields of ``_share_cuda_`` plus the tensor's place).

    Attributes:
        device_uuid: the GPU's UUID (``torch.cuda.get_device_properties(i).uuid``): device indices differ
            between processes, UUIDs do not.
        handle: the CUDA IPC memory handle of the allocation holding the cache (bytes).
        storage_nbytes / storage_offset: the storage's size and its offset in that allocation (bytes).
        ref_counter / ref_counter_offset: torch's shared reference counter of the sent storage.
        event_handle / event_sync: torch's IPC event, waited on when the storage is first mapped.
        tensor_offset: the cache's offset in its storage (elements).
        num_blocks: the sender's cache's blocks; dtype, page_shape: its layout after the block axis
            (``[num_layers, 2, block_size, num_kv_heads, head_dim]``).
    """

    device_uuid: str
    handle: bytes
    storage_nbytes: int
    storage_offset: int
    ref_counter: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync: bool
    tensor_offset: int
    num_blocks: int
    dtype: str
    page_shape: list


@dataclass(frozen=True)
class IpcHello(CacheShare):
    """First frame of a connection: the request, and the sender's cache as :class:`CacheShare` says.
    ``sender_id`` names the sender across requests (the prefill worker's id), so a receiver maps its
    cache once and forgets it when the worker leaves the registry."""

    request_id: str = ""
    sender_id: str = ""


@dataclass(frozen=True)
class IpcPages:
    """Copy ``src_block_ids`` of the sender's cache (layers ``[layer_start, layer_end)``) into the
    receiver's ``dst_block_ids``, pairwise. Lists of ints (checked by the receiver)."""

    request_id: str
    layer_start: int
    layer_end: int
    src_block_ids: list
    dst_block_ids: list


ControlFrame = IpcHello | IpcPages
_SHARE_FIELDS = {"device_uuid": str, "handle": bytes, "storage_nbytes": int, "storage_offset": int,
                 "ref_counter": bytes, "ref_counter_offset": int, "event_handle": bytes, "event_sync": bool,
                 "tensor_offset": int, "num_blocks": int, "dtype": str, "page_shape": list}
_CODEC = ControlCodec({
    "ipc_hello": (IpcHello, {"request_id": str, "sender_id": str, **_SHARE_FIELDS}),
    "ipc_pages": (IpcPages, {"request_id": str, "layer_start": int, "layer_end": int, "src_block_ids": list,
                             "dst_block_ids": list}),
})


encode_control = _CODEC.encode
"""Length prefix + msgpack header of one control frame (:meth:`~kvtransfer.wire.control.ControlCodec.encode`)."""
read_any = _CODEC.read_any
"""One frame header: a control frame of this module or a frame of :mod:`kvtransfer.wire.frames`
(:meth:`~kvtransfer.wire.control.ControlCodec.read_any`, which says what it raises)."""
expect = _CODEC.expect
"""``frame`` if it is a given class (:meth:`~kvtransfer.wire.control.ControlCodec.expect`)."""
