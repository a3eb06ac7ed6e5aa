"""NCCL backend of the KV transfer interface: pages move GPU to GPU by ncclSend/ncclRecv over a
per-pair communicator; a TCP control connection per request carries the unique-id exchange,
page headers, done/ack and abort (see :mod:`.control`). Importing this package loads nothing;
the NCCL library is loaded when a sender or receiver is built (:func:`.library.load_library`)."""

from pdserve.kvtransfer.nccl.library import NcclError, NcclLibrary, NcclUnavailable, load_library
from pdserve.kvtransfer.nccl.receiver import NcclKVReceiver
from pdserve.kvtransfer.nccl.sender import NcclKVChannel, NcclKVSender

__all__ = ["NcclError", "NcclKVChannel", "NcclKVReceiver", "NcclKVSender", "NcclLibrary", "NcclUnavailable",
           "load_library"]
