"""A request's lifecycle: one enum, one name per state, for the router and both kinds of worker.

Each process keeps a request in the states it owns (time runs down; ``──►`` is an RPC or KV pages)::

  router (router/)                 prefill worker P (prefill_worker/)     decode worker D (decode_worker/)
  ───────────────────────────────  ────────────────────────────────────   ─────────────────────────────────
  QUEUED      choose P; admission
              (Redis reservations);
              open D.Generate ──────────────────────────────────────────► TRANSFERRING  blocks pre-allocated,
                                                                                        ids sent back; waits for
  PREFILLING  P.Prefill ─────────► QUEUED        waits for blocks                       the pages (kv_timeout_s)
              (one call: P's                     (cached prefix             │
              PREFILLING and                     matched, rest              │
              TRANSFERRING look                  allocated)                 │
              the same here)       PREFILLING    a chunk per step;          │
                                                 each finished block's      │
                                                 pages ───────────────────► │ written into D's blocks
                                   TRANSFERRING  last pages, then the       │
                                                 first token ──done───────► │ every page there?
                                   FINISHED      ◄──ack────────────────── DECODING  continuous batch:
  DECODING    first token ◄─────── blocks released                                  one token (or the
              (P's answer), then                                                    accepted drafts) a step
              D's tokens ◄─────────────────────────────────────────────── tokens
  FINISHED    final message ◄──────────────────────────────────────────── FINISHED  stop | length;
                                                                                    blocks freed

Colocated workers (role ``both``) skip P: the router opens ``D.Generate`` with ``local_prefill`` and
D runs ``PREFILLING`` itself (chunks mixed with decodes) → ``DECODING`` → ``FINISHED``, never
``TRANSFERRING``.

Failures, from the router's side (:mod:`router.recovery`). Every attempt is a new request on the
workers, under its own attempt id (the router's id for the request, ``-k`` appended for attempt
``k >= 2``); the failed attempt's calls are cancelled, so its workers end it ``FINISHED`` (abort)
and free its blocks::

  attempt k:  QUEUED ──► PREFILLING ──► DECODING ──► FINISHED (stop | length)
                │            │             │
                └────────────┴──────┬──────┘ a worker failed (died, cut the stream, failed the transfer)
                                    ▼
                     no token streamed yet? ──yes──► RETRY    the prompt again, from QUEUED
                                    │ no
                                    └──────────────► MIGRATE  from QUEUED: a P prefills prompt + the
                                                              streamed tokens, another D resumes after them
              attempt k+1 starts at QUEUED (failed workers ranked last) while k < max_attempts and the
              client's deadline leaves time; else FINISHED (error: UNAVAILABLE naming every failure)

  any state ──► FINISHED (error | abort): a bad request, no worker or no room, not admitted, the
                client cancelled or its deadline passed.

Who holds the KV blocks: D from allocation (``TRANSFERRING``) until its ``FINISHED``, on every path
(finish, cancel, failed or timed-out transfer); P its own copy from admission (``PREFILLING``) until
the transfer ends, acknowledged or not. Failure by failure: ``docs/lifecycle.md``.
"""

from __future__ import annotations

import enum

__all__ = ["RequestState"]


class RequestState(enum.Enum):
    """Where a request is in its lifecycle (module docstring). Each role uses the states it owns:

    - router: ``QUEUED``, ``PREFILLING`` (P's ``PREFILLING`` and ``TRANSFERRING``: one call),
      ``DECODING``, ``FINISHED``;
    - prefill worker: ``QUEUED``, ``PREFILLING``, ``TRANSFERRING``, ``FINISHED``;
    - decode worker: ``TRANSFERRING`` (blocks pre-allocated, waiting for the pages), ``PREFILLING``
      (colocated: it prefills the prompt itself; any mode: a preempted request prefilled again),
      ``DECODING``, ``FINISHED``.
    """

    QUEUED = "queued"              # router: workers being chosen, admission; P: waiting for blocks
    PREFILLING = "prefilling"      # the prompt's KV computed chunk by chunk (on P; on D when colocated)
    TRANSFERRING = "transferring"  # pages in flight; D holds the pre-allocated blocks
    DECODING = "decoding"          # D: in the continuous batch
    FINISHED = "finished"          # stop, length, abort or error; the blocks are freed
