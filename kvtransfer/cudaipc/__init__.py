"""CUDA IPC backend of the KV transfer interface: a decode worker maps the prefill worker's CUDA KV cache
(a CUDA IPC handle, once per sender) and copies each request's pages device to device; a TCP control
connection per request carries the handle, the page lists, done/ack and abort (see :mod:`.control`).
For workers whose GPUs one process can see: two workers on one GPU, which NCCL cannot join."""

from pdserve.kvtransfer.cudaipc.receiver import CudaIpcKVReceiver
from pdserve.kvtransfer.cudaipc.sender import CudaIpcKVChannel, CudaIpcKVSender

__all__ = ["CudaIpcKVChannel", "CudaIpcKVReceiver", "CudaIpcKVSender"]
