"""TCP backend of the KV transfer interface: one connection per request, msgpack headers,
pages sent from and received into the KV cache memory without copies (frames: :mod:`kvtransfer.wire.frames`)."""

from pdserve.kvtransfer.tcp.receiver import TcpKVReceiver
from pdserve.kvtransfer.tcp.sender import TcpKVChannel, TcpKVSender

__all__ = ["TcpKVChannel", "TcpKVReceiver", "TcpKVSender"]
