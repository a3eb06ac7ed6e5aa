"""KV page transfer between prefill and decode workers (see :mod:`kvtransfer.base`)."""

from pdserve.kvtransfer.base import KVChannel, KVReceiver, KVSender, TransferError, TransferStats

__all__ = ["KVChannel", "KVReceiver", "KVSender", "TransferError", "TransferStats"]
