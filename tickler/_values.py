"""The values that cross the store seam (see ``_stores._seam``), named and frozen.

The engine's side (``_stores._sync.StoreSync``) builds them and reads what comes
back; a store (``_stores._sql.run_batch`` and its dialects) reads and returns
them. This module imports nothing of either side.

Each is a ``typing.NamedTuple``: one is built per request enqueued, per attempt
ended and per row claimed, on the hot paths of a burst of enqueues and of a
drain, where a NamedTuple is built about twice as fast as a frozen attrs class,
and a store that needs them positionally (a row of its statement's parameters)
still reads them by index.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple


class Insert(NamedTuple):
    """A request to insert: one of ``Batch.inserts``.

    The store writes the first seven fields; ``ticket`` is the engine's own (the ticket
    that gets the row's id once the batch commits), and a store never reads it.
    """

    key: str | None
    """The request's key, encoded (see ``_codec.encode_key``), or None."""
    state: str
    """"queued", or "scheduled" (run_at is later)."""
    request: bytes
    """The request, encoded by the queue's codec."""
    run_at: float
    """When the row falls due, on this process's clock (time.time())."""
    priority: int = 0
    """The higher, the earlier claimed."""
    unique_until: float | None = None
    """Until when (this process's clock; math.inf: for ever) the row holds its key after
    it ends, or None."""
    group: str | None = None
    """The row's group (see Batch.limits), or None."""
    ticket: Any = None
    """The engine's ticket of the request; never written."""


class OutcomeKind(enum.StrEnum):
    """How an attempt ended (or a claimed row went back), as an Outcome writes it."""

    SUCCEEDED = "succeeded"
    RETRYING = "retrying"
    """Failed, and due again at run_at."""
    FAILED = "failed"
    CANCELLED = "cancelled"
    HANDED_BACK = "handed_back"
    """Started, and given back to the queue unfinished (a stop), due at run_at."""
    RETURNED = "returned"
    """Claimed but never started: given back, the claim's attempt undone."""


class Outcome(NamedTuple):
    """An attempt that ended: one of ``Batch.outcomes``.

    The store writes it only while the row runs under the batch's owner's lease, at
    ``attempt`` (None: at whichever attempt). A cancel asked for the row wins over every
    kind but CANCELLED's own: the row ends CANCELLED.
    """

    kind: OutcomeKind
    id: int
    """The row's id."""
    at: float
    """This process's time (time.time()) of the outcome: when the attempt ended, or, for
    RETRYING, HANDED_BACK and RETURNED, the row's new run_at. (A store takes the time a
    row ends from its own clock: only the run_at is written.)"""
    result: bytes | None = None
    """SUCCEEDED: the handler's result, encoded (None: it returned None)."""
    error_type: str | None = None
    """RETRYING and FAILED: the error's type name, message and traceback."""
    error_message: str | None = None
    error_traceback: str | None = None
    attempt: int | None = None
    """The row's attempt the outcome is for (its ``attempts`` column); None: any."""


class ClaimedRow(NamedTuple):
    """A row a batch claimed: one of ``BatchResult.claimed``."""

    id: int
    request: bytes
    attempts: int
    """The row's attempts, this claim's included."""
    key: str | None
    enqueued_at: float
    """On the store's clock (see BatchResult.shift)."""
    run_at: float
    """When the row fell due, on the store's clock."""
    priority: int
    rescued: str | None
    """Why this claim rescued the row ("owner_died", "lease_lapsed"), or None: it was
    ready."""


class ClaimTrace(NamedTuple):
    """A claimed row's trace context and what an attempt's span names: one of
    ``BatchResult.traces``."""

    traceparent: str | None
    """The W3C trace context of the span that enqueued the row, or None."""
    tracestate: str | None
    key: str | None
    priority: int
    group: str | None


class Tick(NamedTuple):
    """A periodic tick: one of ``Batch.ticks``."""

    name: str
    """The periodic's name: the store's record of its last tick is by (queue, name)."""
    tick_at: float
    """The tick's wall-clock time, its identity (never moved by BatchResult.shift)."""
    catch_up: bool
    """Only make the record if there is none: enqueue nothing for this tick."""
    request: bytes
    """The request to enqueue, encoded."""
    priority: int


class GroupLimit(NamedTuple):
    """What limits one group's claims: a value of ``Batch.limits``.

    Each applies to the group on its own, across every process; None: no bound.
    """

    concurrency: int | None
    """The most running rows of the group whose lease has not run out."""
    rate: int | None
    """The most attempts of the group claimed within any window of ``per`` seconds."""
    per: float
