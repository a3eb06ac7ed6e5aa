"""What a KV receiver does with a bound transfer's frames, shared by the TCP and NCCL backends: check announced
pages against the cache layout and the transfer's blocks, finish it on ``done`` (the ack to send), fail it on the
sender's ``abort`` or on a connection error. Mixed into :class:`~kvtransfer.wire.listener.ListeningReceiver`,
whose ``_pending`` (:class:`~kvtransfer.wire.pending.PendingTransfers`) and ``_spec`` these use; each runs on
the connection's handler thread.
"""

from __future__ import annotations

from pdserve.kvtransfer.wire.conn import Conn, call_quietly
from pdserve.kvtransfer.wire.frames import Abort, Ack, Done, FrameError, Pages, check_pages
from pdserve.kvtransfer.wire.pending import PendingTransfer


class TransferFrames:
    """Frame actions on the pending transfer a connection feeds (module doc)."""

    def _take_failed(self, conn: Conn, why: str) -> str | None:
        """Fail ``conn``'s request with ``why`` if this call takes it. Returns the nack's error text:
        ``why``, or why the request is no longer registered; None when no request is bound."""
        transfer = conn.transfer
        if transfer is None:
            return None
        if self._pending.take(transfer, why):
            call_quietly(transfer.on_failed, transfer.request_id, why)
            return why
        return f"request {transfer.request_id!r} is no longer registered: {transfer.ended}"  # ended elsewhere

    def _check_pages(self, transfer: PendingTransfer, frame: Pages) -> None:
        """Raise :class:`FrameError` unless ``frame`` matches the cache layout and names only ``transfer``'s blocks."""
        check_pages(frame, self._spec)
        foreign = [b for b in frame.block_ids if b not in transfer.block_set]
        if foreign:
            raise FrameError(f"request {transfer.request_id!r}: block ids {foreign[:16]} are not registered for it")

    def _check_live(self, transfer: PendingTransfer) -> None:
        """Raise :class:`FrameError` if ``transfer`` was ended (cancel, deadline, close). Call it holding
        ``transfer.write_lock``."""
        if not self._pending.is_live(transfer):
            raise FrameError(f"request {transfer.request_id!r} is no longer registered: {transfer.ended}")

    def _finish(self, transfer: PendingTransfer, frame: Done) -> Ack:
        """``done`` arrived: end ``transfer``, run its callback and return the ack to send.

        Raises:
            FrameError: ``transfer`` was already ended elsewhere.
        """
        taken, complete = self._pending.finish(transfer)
        if not taken:
            raise FrameError(f"request {transfer.request_id!r} is no longer registered: {transfer.ended}")
        if complete:
            call_quietly(transfer.on_complete, transfer.request_id, frame.first_token)
        else:
            call_quietly(transfer.on_failed, transfer.request_id, transfer.ended)
        return Ack(transfer.request_id, complete, "" if complete else transfer.ended or "")

    def _on_abort(self, transfer: PendingTransfer, frame: Abort) -> None:
        """The sender gave up: fail ``transfer`` with its reason (if it is still registered)."""
        why = f"aborted by sender: {frame.reason}"
        if self._pending.take(transfer, why):
            call_quietly(transfer.on_failed, transfer.request_id, why)
