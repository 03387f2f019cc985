"""The store seam: what the engine asks of a store, and the values that cross it.

The engine calls a store once per wake-up of its supervisor loop, on the
store's worker thread: one :class:`Batch` in, one :class:`BatchResult` out, in
one transaction. Besides that a session looks up, cancels and counts; a store
may offer a :class:`Listener` that wakes the loop when another process
enqueues (None: the loop polls). Nothing here knows a database.

The protocols are private: a store outside tickler would implement them
once they are stable enough to be promised.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import attrs

from .._values import ClaimedRow, ClaimTrace, GroupLimit, Insert, Outcome, OutcomeKind, Tick

__all__ = [
    "Batch",
    "BatchResult",
    "ClaimTrace",
    "ClaimedRow",
    "GroupLimit",
    "Insert",
    "Listener",
    "Outcome",
    "OutcomeKind",
    "Row",
    "Session",
    "Store",
    "Tick",
]


@attrs.define(eq=False)
class Row:
    """A request as the store has it."""

    id: int
    key: str | None
    state: str
    request: bytes
    result: bytes | None
    error_type: str | None
    error_message: str | None
    error_traceback: str | None
    attempts: int
    enqueued_at: float
    started_at: float | None
    finished_at: float | None


@attrs.define(eq=False)
class Batch:
    """What one wake-up of a loop writes and asks, in one transaction."""

    inserts: Sequence[Insert] = ()
    """Each request enqueued since the last batch (its ``ticket`` is the engine's own)."""
    outcomes: Sequence[Outcome] = ()
    """Each attempt that ended since the last batch (see Outcome)."""
    claim: int = 0
    """How many ready rows to claim."""
    renew: bool = False
    """Renew this process's leases, and report which it still holds."""
    watched: Sequence[int] = ()
    """Ids whose final state is asked for."""
    prune: bool = False
    finished_since: float | None = None
    """Report the ids of the queue's requests that became final at or after this time."""
    started: Sequence[int] = ()
    """Ids of attempts that started since their row was claimed, and still run."""
    started_time: float | None = None
    """The store's time by which the ``started`` attempts had started (a former batch's
    time, see StoreSync.seen), written as their start; None: the batch's own time."""
    isolate: bool = False
    """Insert each row in a savepoint of its own: a row the store refuses is reported
    in BatchResult.refused, and the rest of the batch commits (see _sql.run_batch)."""
    pause: bool | None = None
    """If not None, set the queue's paused flag to it (for every process), before the claim:
    a paused queue's claims take nothing, while its running rows keep their leases."""
    traces: Sequence[tuple[str, str] | None] | None = None  # (traceparent, tracestate)
    """With tracing on (else None): for each of ``inserts``, the W3C (traceparent,
    tracestate) of its enqueue span, or None, written into the row of each request that
    is new; and the claim then also reads each claimed row's (see BatchResult.traces)."""
    ticks: Sequence[Tick] = ()
    """Periodic ticks. Each is taken by one
    process only, against the queue's record of the name: with no record yet, the record
    is made and the request enqueued unless catch_up; with a record of an earlier tick, the
    request is enqueued; else nothing. tick_at is the tick's wall-clock time, its identity
    (never moved by BatchResult.shift); an enqueued request is queued, due now."""
    limits: Mapping[str, GroupLimit] | None = None
    """Per-group limits of the claim, or None: none (the claim as without groups). By group
    name, and "*" for every group not named: each limit applying
    to each group on its own, across every process. concurrency (or None: no bound) bounds
    the group's running rows whose lease has not run out; rate (or None) the attempts of
    the group claimed within any window of per seconds (a retry, or the rescue of a lapsed
    lease, is an attempt too). Rows of no group are never limited. A group at its limit
    holds back none of the others: the claim takes the next rows past it. The store keeps
    the mapping as the last batch gave it, for statistics and inspection."""


@attrs.define(eq=False)
class BatchResult:
    inserted: list[tuple[int, bool]] = attrs.Factory(list)
    """For each insert: (id, whether it is new; False: its key was live)."""
    applied: list[str | None] = attrs.Factory(list)
    """For each outcome: the state it wrote, or None if this process no longer held the lease."""
    claimed: list[ClaimedRow] = attrs.Factory(list)
    """The rows claimed, in the order they are to start: the higher priority first, then as
    they fell due, then by id."""
    next_due: float | None = None
    """When the queue's next ready row falls due (the store's clock), after the batch; None
    if it has none. Also None after a claim with Batch.limits that left due rows waiting
    for their group's limit (limited > 0): the loop then waits for its next look or a
    wake-up, not for a row falling due (a store may skip asking for it)."""
    mine: dict[int, bool] | None = None
    """With renew: the running requests this process holds, and whether each is to be cancelled."""
    finals: list[Row] = attrs.Factory(list)
    pruned: int = 0
    now: float = 0.0
    """The transaction's time."""
    shift: float = 0.0
    """The store's clock minus this process's (time.time()), never less: see _sql.Dialect.now."""
    missing: list[int] = attrs.Factory(list)
    """Watched ids with no row at all: deleted by a retention before they were read."""
    recent: list[int] = attrs.Factory(list)
    """With finished_since: the ids that became final since then."""
    live: int = 0
    """1 if any request of the queue is queued, scheduled, running or retrying, in any process."""
    refused: dict[int, str] = attrs.Factory(dict)
    """With isolate: for each insert the store refused, by its position in Batch.inserts,
    the error in one line; its entry in inserted is (0, False)."""
    paused: bool = False
    """Whether the queue is paused, after the batch."""
    ticked: list[int] = attrs.Factory(list)
    """For each of Batch.ticks: the id of the request it enqueued, or 0."""
    traces: dict[int, ClaimTrace] = attrs.Factory(dict)
    """With Batch.traces: each claimed row's, by its id."""
    limited: int = 0
    """With Batch.limits and a claim: how many of the queue's ready rows (queued, or
    scheduled or retrying and due) wait only because their group is at its limit, after
    the claim; else 0."""
    lost: bool = False
    """The owner's liveness lock was found lost while this process lives (its session
    was ended, its lock file replaced): the batch renewed and claimed nothing, and the
    owner's rows are others' to rescue. The caller withdraws its attempts as for a lost
    lease, and runs the next batch under a new owner id, which takes a new lock."""


class Session(Protocol):
    """One service's connection to its store, used by one thread at a time (blocking calls)."""

    finals_overlap: float
    """How far each look at what became final reaches back before the last look."""

    def run(
        self, queue: str, owner: str, lease: float, retention: float, batch: Batch
    ) -> BatchResult:
        """Write and ask everything in ``batch`` in one transaction, as ``owner``, holding
        ``owner``'s liveness lock while the session lives (taken by its first batch)."""
        ...

    def lookup(self, queue: str, id_or_key: object) -> Row | None:
        """The queue's row of an id, or of a key (its live row first, else its latest)."""
        ...

    def cancel(self, queue: str, id_or_key: object) -> tuple[bool, int | None]:
        """Cancel a live request: at once unless it runs, else ask its owner.

        Returns whether a live request was found, and its id.
        """
        ...

    def statistics(self, queue: str) -> dict[str, int]:
        """The queue's rows by state; "claimed" are running rows whose attempt has not started."""
        ...

    def close(self) -> None: ...


class Listener(Protocol):
    """Wakes a loop whenever another process enqueued on its queue."""

    async def run(self, wake: Callable[[], None]) -> None: ...


class Store(Protocol):
    """What ``Service(store=...)`` accepts."""

    lease: float
    poll_interval: float
    retention: float

    def connect(self) -> Session:
        """Open a session; blocking, called on the service's worker thread."""
        ...

    def listener(self, queue: str) -> Listener | None: ...

    def use_codec(self, queue: str, codec: Any) -> None:
        """Encode what ``enqueue_in`` writes to ``queue`` with the codec of its service."""
        ...
