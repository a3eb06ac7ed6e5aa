"""The KV transfer interface: how a prefill worker's KV pages reach a decode worker.

A transfer moves the pages of one request: (request id, layer range, block ids).
The prefill side opens a :class:`KVChannel` per request, sends pages as they are
ready, and ends with :meth:`KVChannel.finish` (carrying the first token) or
:meth:`KVChannel.abort`. The decode side registers each request it pre-allocated
blocks for with :meth:`KVReceiver.expect` and is told exactly once, through a
callback, whether the request's KV arrived complete or failed::

    prefill worker P                               decode worker D
    ----------------                               ---------------
                                                   expect(req, block_ids, deadline)
    ch = sender.open(req, D.kv_address)  ──TCP──►  (connection accepted)
    ch.send_pages(layers, src, dst)      ──pages─►  recv_into(kv_cache[dst, layers])
    ch.finish(first_token)               ──done──►  all (block, layer) pages seen?
                                         ◄──ack──   on_complete(req, first_token) | on_failed(req, why)

Modelled on SGLang's ``srt/disaggregation/base/conn.py`` (a poll state machine
that ends in success or failure) and vLLM's KV connector interface; kept to a
handful of methods. Backends live in one sub-package each (``kvtransfer/tcp``,
``kvtransfer/nccl``) over the socket layer they share (``kvtransfer/wire``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass


class TransferError(RuntimeError):
    """A transfer failed: broken or refused connection, timeout, bad frame, or the
    receiver rejected the pages. The message names the request and the cause."""


@dataclass(frozen=True)
class TransferStats:
    """What one finished transfer moved.

    Attributes:
        num_pages: KV pages sent (one page = one block x one layer range).
        num_bytes: payload bytes sent, headers excluded.
        seconds: wall time from open to the receiver's acknowledgement.
    """

    num_pages: int
    num_bytes: int
    seconds: float


OnComplete = Callable[[str, int], None]
"""``on_complete(request_id, first_token)``: every expected page and the first token arrived."""

OnFailed = Callable[[str, str], None]
"""``on_failed(request_id, reason)``: the transfer broke, timed out or was refused."""


class KVChannel(ABC):
    """Prefill side of one request's transfer. Not thread-safe: one sender thread uses it."""

    @abstractmethod
    def send_pages(self, layer_range: tuple[int, int], src_block_ids: Sequence[int],
                   dst_block_ids: Sequence[int]) -> None:
        """Send the KV of ``layer_range`` (start, end exclusive) of the local blocks
        ``src_block_ids`` into the receiver's blocks ``dst_block_ids`` (same length, same order).

        Raises:
            TransferError: the connection failed or timed out.
            ValueError: lengths differ or the layer range is empty or out of range.
        """

    @abstractmethod
    def finish(self, first_token: int) -> TransferStats:
        """Tell the receiver the request's KV is complete and hand it the first token;
        wait for its acknowledgement. Closes the channel.

        Raises:
            TransferError: the receiver rejected the transfer (e.g. pages missing) or did not answer in time.
        """

    @abstractmethod
    def abort(self, reason: str) -> None:
        """Tell the receiver to fail the request (best effort; never raises) and close."""


class KVSender(ABC):
    """Prefill side: opens channels from a local KV cache tensor to decode workers."""

    @abstractmethod
    def open(self, request_id: str, dst_address: str) -> KVChannel:
        """Connect to the receiver at ``dst_address`` ("host:port") for ``request_id``.

        Raises:
            TransferError: the receiver cannot be reached in time.
        """

    @abstractmethod
    def close(self) -> None:
        """Release every resource; open channels are aborted."""


class KVReceiver(ABC):
    """Decode side: accepts pages into pre-allocated blocks of a local KV cache tensor."""

    @property
    @abstractmethod
    def address(self) -> str:
        """``host:port`` that senders connect to."""

    @abstractmethod
    def expect(self, request_id: str, block_ids: Sequence[int], timeout_s: float,
               on_complete: OnComplete, on_failed: OnFailed) -> None:
        """Register a request whose KV will arrive into ``block_ids`` (its block table).

        Exactly one of the callbacks is called, once, from a receiver thread: ``on_complete``
        when every page of every layer of every block and the first token have arrived,
        ``on_failed`` on a broken connection, a bad frame, or when ``timeout_s`` seconds pass
        first. Pages for blocks or layers outside the registration are refused.

        Raises:
            ValueError: ``request_id`` is already registered.
        """

    @abstractmethod
    def cancel(self, request_id: str) -> None:
        """Forget a registration (no callback follows); later pages for it are refused. Idempotent."""

    @abstractmethod
    def close(self) -> None:
        """Stop accepting; pending registrations fail with ``on_failed``."""
