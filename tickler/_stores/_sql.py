"""The transaction every SQL store runs per batch, written once over a Dialect.

A store's session is its own :class:`Dialect`: it writes its own SQL, in its
own placeholder style, and says how to begin, commit, claim and the rest.
What the dialects share is this script, the statements' order and
parameters (:class:`Statements`), and SQL text without placeholders: the
SET clause of each outcome and the lists of states. Connection handling
(a pipeline, reconnects) stays with each store, around :func:`run_batch`.
"""

from __future__ import annotations

import json
import math
import operator
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import attrs

from .._codec import Codec, JsonCodec, check_group, check_queue_name, encode_key
from .._core import MAX_ID, _check_delay, _one_line, check_priority, check_unique_for
from .._exceptions import StoreError
from .._states import CLAIMED, COUNTED, COUNTED_LIVE
from .._values import ClaimedRow, ClaimTrace, GroupLimit, Insert, Outcome, OutcomeKind, Tick
from ._seam import Batch, BatchResult, Row

# The sets of states statistics() and inspect count by: tickler/_states.py's.
# The state statistics() counts a row under, as an SQL expression.
COUNTED_STATE = (
    f"CASE WHEN state = 'running' AND started_at IS NULL THEN '{CLAIMED}' ELSE state END"
)

# What each outcome sets, from the columns of a row v of its values: column1
# is the id, then the outcome's values (OUTCOME_FIELDS), then its attempt, then {now},
# the transaction's time.
# Every finished_at is that time, taken once the write lock is held, so that
# rows become final in the order of finished_at (see Batch.finished_since).
SETS = {
    # Once its cancel was asked for, a request ends CANCELLED, even if its
    # handler returned (or failed) before the cancel reached it.
    OutcomeKind.SUCCEEDED: (
        "state = CASE WHEN cancel_requested THEN 'cancelled' ELSE 'succeeded' END,"
        " result = CASE WHEN cancel_requested THEN NULL ELSE v.column2 END,"
        " finished_at = {now}, started_at = coalesce(started_at, {now})"
    ),
    # A request whose cancel was asked for is never retried nor handed back.
    OutcomeKind.RETRYING: (
        "state = CASE WHEN cancel_requested THEN 'cancelled' ELSE 'retrying' END,"
        " finished_at = CASE WHEN cancel_requested THEN {now} END,"
        " run_at = v.column2, error_type = v.column3,"
        " error_message = v.column4, error_traceback = v.column5,"
        " started_at = coalesce(started_at, {now})"
    ),
    OutcomeKind.FAILED: (
        "state = CASE WHEN cancel_requested THEN 'cancelled' ELSE 'failed' END,"
        " finished_at = {now}, error_type = v.column3,"
        " error_message = v.column4, error_traceback = v.column5,"
        " started_at = coalesce(started_at, {now})"
    ),
    OutcomeKind.CANCELLED: (
        "state = 'cancelled', finished_at = {now}, started_at = coalesce(started_at, {now})"
    ),
    OutcomeKind.HANDED_BACK: (
        "state = CASE WHEN cancel_requested THEN 'cancelled' ELSE 'queued' END,"
        " finished_at = CASE WHEN cancel_requested THEN {now} END, run_at = v.column2,"
        " started_at = coalesce(started_at, {now})"
    ),
    # Claimed but never started: handed back, and the claim's attempt undone.
    OutcomeKind.RETURNED: (
        "state = CASE WHEN cancel_requested THEN 'cancelled' ELSE 'queued' END,"
        " finished_at = CASE WHEN cancel_requested THEN {now} END, run_at = v.column2,"
        " attempts = attempts - 1"
    ),
}

# The columns of a Row, in its order.
ROW_COLUMNS = (
    "id, key, state, request, result, error_type, error_message, error_traceback,"
    " attempts, enqueued_at, started_at, finished_at"
)

INSERT_COLUMNS = (
    "INSERT INTO tickler_requests"
    " (queue, key, state, request, run_at, enqueued_at, priority, unique_until, group_name)"
)

# Rows without a key go many to an INSERT, at most this many.
ROWS_PER_STATEMENT = 150
# Final rows a batch deletes at most.
PRUNE_BATCH = 1000

# The order of claimed rows: the higher priority first; of one priority, as they fell
# due, then as they were enqueued.


# A claimed row as a dialect's claim gives it: ClaimedRow's columns, in its order.
Claimed = tuple[Any, ...]


def _claim_order(row: ClaimedRow) -> tuple[int, float, int]:
    return -row.priority, row.run_at, row.id


# Why a running row was claimed again (its column ``rescued``, and the counts of
# tickler_rescues): its owner's liveness lock was free (the process died, or lost the
# lock), or its lease ran out (the process is alive but stuck, partitioned from the
# store, or its lock was never known).
OWNER_DIED = "owner_died"
LEASE_LAPSED = "lease_lapsed"
RESCUE_REASONS = (OWNER_DIED, LEASE_LAPSED)
# A running row whose owner's lock was found free gets as lease_until the time that was
# found, negated: lapsed at once, and told apart from a lease that ran out (the leases
# are epoch times, > 0).
# What a claim sets besides its own columns, in both dialects: a running row claimed
# again is a rescue, and records its reason and time ({now}: the claim's time). SET
# reads the row's old values.
RESCUE_SETS = (
    "rescued = CASE WHEN state = 'running' THEN"
    " CASE WHEN lease_until < 0 THEN 'owner_died' ELSE 'lease_lapsed' END ELSE rescued END,"
    " rescued_at = CASE WHEN state = 'running' THEN {now} ELSE rescued_at END"
)
# What a claim returns after the priority: the reason if this claim rescued the row,
# else NULL ({now}: the claim's time, as in RESCUE_SETS). RETURNING reads the new values.
RESCUE_RETURNED = "CASE WHEN rescued_at = {now} THEN rescued END"


@attrs.frozen
class Statements:
    """The statements the script runs as they are, each written in its dialect's style.

    Each takes its parameters positionally, in the order its comment gives.
    """

    insert: str
    """(queue, key, state, request, run_at, enqueued_at, priority, unique_until, group_name,
    queue, key, now): RETURNING id; no row if the key is taken: live, or held by a row whose
    unique_until is after now."""
    holder_of_key: str
    """(queue, key, now): the id of the row that holds the key: its live row, else the
    latest whose unique_until is after now."""
    renew: str
    """(lease_until, queue, owner): every running lease of owner's, but those a look found
    the owner's lock free for (lease_until < 0: they are another's to rescue)."""
    mine: str
    """(queue, owner): (id, cancel_requested) of owner's running rows, as renew has them."""
    count_rescues: str
    """(queue, reason, count): add count to the queue's rescues for that reason."""
    end_cancelled_orphans: str
    """(now, queue, now, owner): rows whose cancel was asked for and whose other owner's
    lease lapsed end CANCELLED; nobody claims them again. The owner's own are left to
    its next look, which withdraws the attempt."""
    recent: str
    """(queue, since): ids of the queue's rows final since then."""
    prune: str
    """(queue, cutoff, now, limit): delete the queue's rows final before cutoff, but for
    those whose unique_until is after now (they hold their key). Each queue's retention
    deletes its own rows only: queues of one store may keep them for different times."""
    has: str
    """(id,): a row, if the id has one."""
    row_by_id: str
    """(queue, id): the Row."""
    set_trace: str
    """(traceparent, tracestate, id): the row's trace context, that of its enqueue span."""
    traces_of: str
    """(ids, as Dialect.listed gives them): (id, traceparent, tracestate, key, priority,
    group_name) of each of those rows."""
    row_by_key: str
    """(queue, key): the Row, the live one first, else the latest."""
    live_by_id: str
    """(queue, id): (id, state) of the live row, locked until the transaction ends."""
    live_by_key: str
    """(queue, key): as live_by_id."""
    ask_cancel: str
    """(id,): ask the owner of a running row to cancel it."""
    cancel_now: str
    """(finished_at, id): a row that does not run ends CANCELLED."""
    counts: str
    """(queue, queue, queue): (state as COUNTED_STATE, count) for each state the queue has,
    ("paused", 1 or 0) if the queue has a row in tickler_queues, and ("rescued_<reason>",
    count) for each reason of the queue's rescues."""
    set_paused: str
    """(queue, paused): set the queue's flag in tickler_queues, inserting its row."""
    tick_insert: str
    """(queue, name, tick_at): insert the periodic's first record; RETURNING a row, none
    if it has one (waiting for another transaction that is inserting it)."""
    tick_advance: str
    """(tick_at, queue, name, tick_at): move the record to tick_at if it is earlier;
    RETURNING a row, none if it was not."""

    # -- Per-group limits (Batch.limits): the claim of claim_limited(), and its counts.
    # A list parameter (groups, ids) is given as Dialect.listed() makes it.
    set_limits: str
    """(queue, limits): write the queue's limits (JSON text) in tickler_queues, inserting
    its row."""
    limits_of: str
    """(queue,): the queue's limits as set_limits wrote them (NULL: none), if it has a row."""
    paused: str
    """(queue,): the queue's paused flag, if it has a row in tickler_queues."""
    running_groups: str
    """(queue, now): (group_name, count) of the running rows of each group whose lease runs
    after now."""
    starts_since: str
    """(queue, since): (group_name, started_at) of each start recorded after since."""
    prune_starts: str
    """(queue, before): delete the queue's starts recorded at or before that time."""
    ready_groups: str
    """(queue, queue): every group that has a ready row, each once, found one at a time on
    the group index (never reading a group's rows beyond its first)."""
    ungrouped_ready: str
    """(queue, now, limit): (id, priority, run_at, group_name) of the ready rows of no
    group due by now, in claim order."""
    expired_rows: str
    """(queue, now, owner, limit): (id, priority, run_at, group_name) of running rows whose
    lease lapsed before now, not owner's, not asked to cancel, the earliest lapsed first."""
    limited_count: str
    """{queue, groups, now} (named): how many ready rows of the listed groups are due by now."""
    limited_upto: str
    """{queue, groups, now, cap} (named): as limited_count, counting no further than cap
    (the answer is then cap)."""
    busiest_groups: str
    """(queue, limit): (group_name, then a count for each state of COUNTED_LIVE) of the
    queue's groups with live rows, the most running (or claimed) first, then the most of
    the other live states, then by name: as busiest_groups() writes it."""
    known_queues: str = attrs.field(factory=lambda: KNOWN_QUEUES)
    """(): every queue the store knows, by name (KNOWN_QUEUES, unless the store's indexes
    call for other words)."""


class Dialect(Protocol):
    """What one SQL store's session says for the script: its SQL and its transaction.

    Every call runs on the session's connection, on its one thread.
    """

    statements: Statements
    reads_after_commit: bool
    """Whether the answers of claim() and due_and_live() may be read once the batch has
    committed: not in SQLite, which cannot commit while a statement has rows to give."""

    def execute(self, sql: str, params: Any = ()) -> Any:
        """Run one statement; a cursor of its answer."""
        ...

    def begin(self) -> None: ...

    def commit(self) -> None: ...

    def rollback(self) -> None:
        """Roll back after an error, if a transaction is open."""
        ...

    def now(self) -> tuple[float, float]:
        """The transaction's time, taken once the write lock is held, and the store's clock
        minus this process's (time.time()), never less than the true difference."""
        ...

    def insert_rows(self, queue: str, entries: Sequence[Insert], now: float) -> Iterable[int]:
        """Insert keyless entries in one statement (their key and unique_until NULL: a row
        without a key holds none); their ids, in their order."""
        ...

    def write_outcomes(
        self, owner: str, outcomes: Sequence[Outcome], now: float
    ) -> Callable[[], list[str | None]]:
        """Each outcome (see run_batch) only while the row is running under owner's lease and
        at the outcome's attempt (None: any), checked in the statement that
        writes it: the state it wrote, or None where the row was no longer so; read by
        calling (as the claim's rows are read, see reads_after_commit)."""
        ...

    def mark_dead(self, queue: str, owner: str, now: float, limit: int) -> None:
        """Lapse at once (lease_until -now) the leases of up to ``limit`` of the queue's
        running rows whose owner's liveness lock is free, but owner's own: the claim that
        follows rescues them. (Only as many as a claim takes: the others keep their lease
        until a claim has room for them.)"""
        ...

    def mark_started(self, owner: str, ids: Sequence[int], now: float) -> None:
        """Write the start of the attempts ``ids``, which run under ``owner``'s lease."""
        ...

    def claim(
        self, queue: str, owner: str, now: float, lease_until: float, limit: int
    ) -> Callable[[], list[Claimed]]:
        """Claim up to ``limit`` ready rows and rows whose lease expired (not owner's own,
        not asked to cancel), the higher priority first, then in the order they fell due,
        then by id; none while the queue is paused. Each claimed row ends with its
        priority (the 7th column) and the reason it was rescued, or None if it was ready
        (the 8th); each rescue is recorded in the row (RESCUE_SETS) and counted
        (Statements.count_rescues) by the claim's transaction. The answer is read by
        calling."""
        ...

    def due_and_live(self, queue: str) -> Callable[[], tuple[float | None, int, bool]]:
        """Ask when the next ready row falls due, whether anything of the queue is live
        (1 or 0), and whether it is paused; the answer is read by calling."""
        ...

    def finals(self, ids: Sequence[int]) -> list[Row]:
        """The final rows among ``ids``."""
        ...

    def notify(self, queue: str) -> None:
        """Tell other processes the batch enqueued (it commits with the batch)."""
        ...

    def after_error_in_transaction(self) -> None:
        """Make the connection take statements again after one failed in the transaction,
        before a rollback to a savepoint."""
        ...

    # -- Per-group limits

    limits_written: dict[str, str]
    """The limits (JSON text) this session last wrote for each queue."""
    limited_memo: dict[str, LimitedMemo]
    """What this session's limited claims of each queue remember (see LimitedMemo)."""

    def listed(self, values: Sequence[Any]) -> Any:
        """A list as one parameter of the statements that take a list."""
        ...

    def lock_limited(self, queue: str) -> None:
        """Hold every other process's limited claim of ``queue`` back until the transaction
        ends. Taken first in a batch that makes one, before any row is written (at the
        latest by the batch's now(), which comes next)."""
        ...

    def ready_chunk(self, queue: str, now: float, size: int) -> Callable[[], list[tuple[Any, ...]]]:
        """Ask for the first ``size`` ready rows of the queue due by now, in claim order,
        whatever their group: (id, priority, run_at, group_name) each; read by calling."""
        ...

    def claim_picked(
        self,
        queue: str,
        owner: str,
        lease_until: float,
        now: float,
        picked: Sequence[tuple[int, str | None]],
        rated: Sequence[str],
    ) -> Callable[[], list[Claimed]]:
        """Claim the rows of the ``picked`` ids (each with its group) that are still ready,
        or running with a lease lapsed before now (not owner's, not asked to cancel), and
        record a start at ``now`` for each row claimed whose group is ``rated``; the rows
        claimed, as Dialect.claim gives them, are read by calling."""
        ...

    @property
    def claim_by_groups(self) -> ClaimByGroups | None:
        """claim_limited's claim group by group in one statement, where the store has one:
        called with (queue, owner, lease_until, now, limit, limits, cap), it claims up to
        ``limit`` rows, as _walk picks them from every group's first due rows, the due rows
        of no group and the lapsed leases, each group's room taken from its running rows and
        its recorded starts at ``now`` (nothing while the queue is paused), a start recorded
        for each row claimed of a rated group. Read by calling: the rows claimed, as
        Dialect.claim gives them; how many due ready rows of the groups left at their limit
        wait, counted no further than ``cap``; those groups; how many groups have ready rows;
        and what due_and_live() answers after the claim, but for the next due time where due
        rows wait for their group's limit (then None: see BatchResult.next_due). None: the
        store reads and walks in claim_limited."""
        ...

    def group_candidates(
        self, queue: str, now: float, rooms: Sequence[tuple[str, int]], default_room: int
    ) -> Callable[[], list[tuple[Any, ...]]]:
        """Ask, for every group that has ready rows, for its first due rows in claim
        order, as many as its room (its entry of ``rooms``, else ``default_room``; none
        for a room of 0), and for its first ready row (due or not) where that gives none
        or is cheaper: each group is in the answer. (id, priority, run_at, group_name)
        each, a row possibly twice. Read by calling."""
        ...


def run_batch(
    d: Dialect, queue: str, owner: str, lease: float, retention: float, batch: Batch
) -> BatchResult:
    """Write and ask everything in ``batch`` in one transaction.

    Each Outcome applies only while the row runs under ``owner``'s lease at its attempt
    (the row's attempts; None: whichever), checked in the statement that writes it: a
    late result of an attempt whose row was rescued is never recorded. What it writes is
    its kind's OUTCOME_FIELDS, through the kind's SETS.

    A batch that claims first lapses the leases of owners whose liveness lock is free, as
    many as it claims (Dialect.mark_dead), so that its claim rescues their rows at once.

    With ``batch.isolate``, each insert runs in a savepoint of its own: a
    row whose insert raises is rolled back alone, reported in
    ``BatchResult.refused`` and entered as (0, False) in ``inserted``,
    and the rest of the batch commits. Without it, any error fails the
    whole batch, and nothing of it is written.

    An Insert finds its key taken if the queue has a live row of the key, or any row of it
    whose unique_until is after the transaction's time: it is then entered as
    (that row's id, False), the live row's first. ``batch.pause`` is written
    before the claim (and a paused queue's claim takes nothing), then
    ``batch.ticks`` (see Batch.ticks); retention never deletes a row that
    holds its key.
    """
    x = d.execute
    sql = d.statements
    result = BatchResult()
    d.begin()
    try:
        if batch.limits is not None and batch.claim:
            # First: a lock taken after the batch's row locks could close a cycle with
            # another process that holds it and waits for one of those rows.
            d.lock_limited(queue)
        now, shift = d.now()
        result.now, result.shift = now, shift
        applied = _write(d, queue, owner, now, shift, batch, result)
        if batch.claim or batch.renew:
            x(sql.end_cancelled_orphans, (now, queue, now, owner))
        if batch.renew:
            x(sql.renew, (now + lease, queue, owner))
            result.mine = {row[0]: bool(row[1]) for row in x(sql.mine, (queue, owner))}
        if batch.pause is not None:
            x(sql.set_paused, (queue, batch.pause))
        claimed, due_and_live_read = _claim(d, queue, owner, lease, now, batch, result)
        # Asked before the claim's rows are read: a server answers both, and
        # with reads_after_commit the COMMIT, in one round trip. (A limited claim may
        # answer it itself.)
        due_and_live = due_and_live_read or d.due_and_live(queue)

        def read() -> None:
            result.applied = applied()
            if claimed is not None:
                rows = list(map(_claimed_row, claimed()))
                rows.sort(key=_claim_order)
                result.claimed = rows
                if batch.traces is not None and rows:
                    result.traces = _read_traces(d, [row[0] for row in rows])
            result.next_due, result.live, paused = due_and_live()
            result.paused = bool(paused)

        if not d.reads_after_commit:
            read()
        if batch.watched:
            _read_finals(d, batch.watched, result)
        cutoff = now - retention
        if batch.finished_since is not None:
            result.recent = [row[0] for row in x(sql.recent, (queue, batch.finished_since))]
            # What this look reports as recent is read at the next look:
            # keep it until then, whatever the retention.
            cutoff = min(cutoff, batch.finished_since)
        if batch.prune:
            result.pruned = x(sql.prune, (queue, cutoff, now, PRUNE_BATCH)).rowcount
        if batch.inserts or any(result.ticked) or batch.pause is not None:
            d.notify(queue)  # once per batch, never per row
        d.commit()
        if d.reads_after_commit:
            read()
    except BaseException:
        d.rollback()
        raise
    return result


def _write(
    d: Dialect, queue: str, owner: str, now: float, shift: float, batch: Batch, result: BatchResult
) -> Callable[[], list[str | None]]:
    """The batch's writes before its claim: its inserts (and their trace context), its
    ticks, the attempts started and the outcomes (see run_batch); what the outcomes
    applied is read by calling."""
    inserts, outcomes = batch.inserts, batch.outcomes
    if shift:
        # The loop's times (an enqueue's run_at and unique_until, an outcome's
        # run_at) are this process's time.time(): moved onto the store's clock.
        inserts = [_shifted_insert(e, shift) for e in inserts]
        # serves: pg drain: only the outcomes that write a run_at are made anew (a
        # success's time is not written: the row ends at the batch's time).
        if any(o.kind in _RUN_AT_KINDS for o in outcomes):
            outcomes = [
                o._replace(at=o.at + shift) if o.kind in _RUN_AT_KINDS else o for o in outcomes
            ]
    if batch.isolate:
        result.inserted = _insert_isolated(d, queue, inserts, now, result.refused)
    else:
        result.inserted = _insert(d, queue, inserts, now)
    if batch.traces:
        _write_traces(d, batch.traces, result.inserted)
    if batch.ticks:
        result.ticked = _tick(d, queue, batch.ticks, now)
    if batch.started:
        at = batch.started_time
        d.mark_started(owner, batch.started, now if at is None else at)
    return d.write_outcomes(owner, outcomes, now)


def _claim(
    d: Dialect, queue: str, owner: str, lease: float, now: float, batch: Batch, result: BatchResult
) -> tuple[Callable[[], list[Claimed]] | None, DueAndLive | None]:
    """The batch's claim, to read once the batch is sent: plain, or under the limits; and,
    where the claim answers it, what Dialect.due_and_live answers.

    With limits, they are also recorded for the queue, and ``result.limited``
    counts the ready rows they hold back. The leases of as many rows of owners whose
    liveness lock is free lapse first: the claim rescues them at once.
    """
    if batch.claim:
        d.mark_dead(queue, owner, now, batch.claim)
    if batch.limits is None:
        plain = d.claim(queue, owner, now, now + lease, batch.claim) if batch.claim else None
        return plain, None
    limits = normal_limits(batch.limits)
    write_limits(d, queue, limits)
    if not batch.claim:
        return None, None
    window = _window(limits)
    if window > 0:  # the starts no window counts any more, whichever way it claims
        d.execute(d.statements.prune_starts, (queue, now - window))
    read, due_and_live = _claim_at_once(
        d, queue, owner, lease, batch.claim, limits, now
    ) or claim_limited(d, queue, owner, lease, batch.claim, limits, now)

    def rows() -> list[Claimed]:
        claimed, result.limited = read()
        return claimed

    return rows, due_and_live


# The kinds of outcome whose ``at`` is a run_at the store writes.
_RUN_AT_KINDS = frozenset((OutcomeKind.RETRYING, OutcomeKind.HANDED_BACK, OutcomeKind.RETURNED))
_claimed_row = ClaimedRow._make


def _write_traces(
    d: Dialect, traces: Sequence[tuple[str, str] | None], inserted: list[tuple[int, bool]]
) -> None:
    """Each new row's trace context: that of the span that enqueued it (see Batch.traces)."""
    for trace, (request_id, new) in zip(traces, inserted, strict=True):
        if trace is not None and new:
            d.execute(d.statements.set_trace, (trace[0], trace[1] or None, request_id))


def _read_traces(d: Dialect, ids: list[int]) -> dict[int, ClaimTrace]:
    """The trace context, key, priority and group of each of the claimed rows ``ids``."""
    rows = d.execute(d.statements.traces_of, (d.listed(ids),)).fetchall()
    return {row[0]: ClaimTrace(row[1], row[2], row[3], row[4], row[5]) for row in rows}


def _read_finals(d: Dialect, watched: Sequence[int], result: BatchResult) -> None:
    """The final rows of the watched ids, and the ids with no row left at all."""
    result.finals = d.finals(watched)
    found = {row.id for row in result.finals}
    has = d.statements.has
    result.missing = [
        i for i in watched if i not in found and d.execute(has, (i,)).fetchone() is None
    ]


def _shifted_insert(entry: Insert, shift: float) -> Insert:
    """An insert whose run_at and unique_until are moved by ``shift`` (its ticket left out:
    the store never reads it)."""
    until = entry.unique_until
    if until is not None:
        until += shift
    return Insert(
        entry.key,
        entry.state,
        entry.request,
        entry.run_at + shift,
        entry.priority,
        until,
        entry.group,
    )


# The fields of an Outcome each kind writes, in the order its SETS reads them (column2
# on); its attempt and the batch's time follow.
OUTCOME_FIELDS = {
    OutcomeKind.SUCCEEDED: ("result", "at"),
    OutcomeKind.RETRYING: ("at", "error_type", "error_message", "error_traceback"),
    OutcomeKind.FAILED: ("at", "error_type", "error_message", "error_traceback"),
    OutcomeKind.CANCELLED: ("at",),
    OutcomeKind.HANDED_BACK: ("at",),
    OutcomeKind.RETURNED: ("at",),
}


# Each kind's values of an Outcome as its statement takes them, before the batch's time:
# (id, its OUTCOME_FIELDS' values, attempt). serves: pg drain: one C call an outcome.
OUTCOME_VALUES: dict[OutcomeKind, Callable[[Outcome], tuple[Any, ...]]] = {
    kind: operator.attrgetter("id", *fields, "attempt") for kind, fields in OUTCOME_FIELDS.items()
}


def _insert(
    d: Dialect, queue: str, inserts: Sequence[Insert], now: float
) -> list[tuple[int, bool]]:
    """Insert in order; requests without a key many to a statement."""
    sql = d.statements
    inserted: list[tuple[int, bool]] = []
    plain: list[Insert] = []

    def flush() -> None:
        for start in range(0, len(plain), ROWS_PER_STATEMENT):
            ids = d.insert_rows(queue, plain[start : start + ROWS_PER_STATEMENT], now)
            inserted.extend((request_id, True) for request_id in ids)
        plain.clear()

    for entry in inserts:
        key = entry.key
        if key is None:
            plain.append(entry)
            continue
        flush()
        params = (
            queue,
            key,
            entry.state,
            entry.request,
            entry.run_at,
            now,
            entry.priority,
            entry.unique_until,
            entry.group,
        )
        inserted.append(
            insert_keyed(
                d.execute,
                sql.insert,
                sql.holder_of_key,
                key,
                (*params, queue, key, now),
                (queue, key, now),
            )
        )
    flush()
    return inserted


def _tick(d: Dialect, queue: str, ticks: Sequence[Tick], now: float) -> list[int]:
    """Take each periodic tick (see Batch.ticks) once across processes: the id each enqueued,
    or 0.

    Each tick is decided against the primary key (queue, name) of
    tickler_periodic: the insert of a first record waits for a transaction
    inserting the same one, and the update of a record for one updating it,
    then finds it already at tick_at. The request enqueued is queued, due now.
    """
    x, sql = d.execute, d.statements
    ticked: list[int] = []
    for tick in ticks:
        name, tick_at = tick.name, tick.tick_at
        if x(sql.tick_insert, (queue, name, tick_at)).fetchone() is not None:
            enqueue = not tick.catch_up
        else:
            enqueue = x(sql.tick_advance, (tick_at, queue, name, tick_at)).fetchone() is not None
        request_id = 0
        if enqueue:
            entry = Insert(None, "queued", tick.request, now, tick.priority)
            (request_id,) = d.insert_rows(queue, [entry], now)
        ticked.append(request_id)
    return ticked


# A savepoint per row of an isolated batch; the same words in every dialect.
_SAVEPOINT = "SAVEPOINT tickler_row"
_ROLLBACK_TO_SAVEPOINT = "ROLLBACK TO SAVEPOINT tickler_row"
_RELEASE_SAVEPOINT = "RELEASE SAVEPOINT tickler_row"


def _insert_isolated(
    d: Dialect,
    queue: str,
    inserts: Sequence[Insert],
    now: float,
    refused: dict[int, str],
) -> list[tuple[int, bool]]:
    """As _insert, one row at a time, each in a savepoint of its own.

    A row whose insert raises is rolled back to its savepoint alone: it
    is entered in ``refused`` (its position, the error in one line) and
    as (0, False) in what this returns, and the batch goes on. If the
    rollback to the savepoint fails too (the connection is lost, or the
    store ended the transaction), the whole batch fails.
    """
    x = d.execute
    inserted: list[tuple[int, bool]] = []
    for position, entry in enumerate(inserts):
        x(_SAVEPOINT)
        try:
            (row,) = _insert(d, queue, (entry,), now)
        except Exception as exc:
            d.after_error_in_transaction()
            x(_ROLLBACK_TO_SAVEPOINT)
            refused[position] = _one_line(exc)
            row = (0, False)
        x(_RELEASE_SAVEPOINT)
        inserted.append(row)
    return inserted


def insert_keyed(
    execute: Callable[[str, Any], Any],
    insert: str,
    live: str,
    key: str | None,
    params: Any,
    live_params: Any = None,
) -> tuple[int, bool]:
    """Insert a request: (its id, True), or (the holder's id, False) if its key is taken.

    ``insert`` is a statement of Statements.insert's kind, run with ``params``;
    ``live`` one of Statements.holder_of_key's, run with ``live_params``
    ((queue, key) by default, the queue being the first of ``params``). Under
    PostgreSQL's READ COMMITTED the holder can end (or its hold run out)
    between the insert that met it and the select that looks for it: then
    insert again.
    """
    if live_params is None:
        live_params = (params[0], key)
    for _ in range(10):
        found = execute(insert, params).fetchone()
        if found is not None:
            return found[0], True
        live_row = execute(live, live_params).fetchone()
        if live_row is not None:
            return live_row[0], False
    raise StoreError(f"the key {key} of queue {params[0]!r} kept changing hands; try again")


_JSON = JsonCodec()


class EnqueueTracer(Protocol):
    """A store's tracer for ``enqueue_in`` and ``enqueue_many_in`` (``tickler.otel``), or None."""

    def send(
        self, queue: str, count: int, write: Callable[[tuple[str, str] | None], list[int]]
    ) -> list[int]:
        """Call ``write`` inside an enqueue span of ``count`` requests, with the span's W3C
        (traceparent, tracestate) for the rows it inserts (None: no valid span); its ids."""
        ...


def traced_enqueue(
    tracer: EnqueueTracer | None,
    queue: str,
    count: int,
    write: Callable[[tuple[str, str] | None], list[int]],
) -> list[int]:
    """``write`` (an enqueue_in's insert, given its trace context), inside an enqueue span
    of ``count`` requests while tickler.otel traces the store; else with no trace."""
    if tracer is None or not count:
        return write(None)
    return tracer.send(queue, count, write)


@attrs.frozen
class Enqueue:
    """What ``enqueue_in`` and ``enqueue_many_in`` write, checked and encoded."""

    keys: list[str | None]
    """Each request's encoded key, or None."""
    requests: list[bytes]
    state: str
    """"queued", or "scheduled" with a delay."""
    delay: float
    """Seconds from the enqueue to run_at: 0.0 without a delay."""
    priority: int
    unique_for: float | None
    """Seconds a keyed row holds its key after it is enqueued (math.inf: for ever), or None."""
    now: float
    """This process's clock when it was prepared."""
    group: str | None = None
    """The group of every request, or None."""


def prepare_enqueue(
    codecs: dict[str, Codec],
    queue: str,
    requests: Iterable[object],
    key: Callable[[Any], object] | None,
    delay: float | None,
    priority: object = 0,
    unique_for: object = None,
    group: object = None,
) -> Enqueue:
    """What ``enqueue_in`` and ``enqueue_many_in`` write, every argument checked and every
    request encoded before anything is written.

    ``key`` gives each request's key (or None); None: no request has one.
    """
    check_queue_name(queue, "queue")
    checked_priority = check_priority(priority)
    hold = check_unique_for(unique_for, key)
    checked_group = check_group(group)
    if key is not None and not callable(key):
        raise TypeError("key must be None or a callable giving each request's key")
    state, wait = "queued", 0.0
    if delay is not None:
        wait = _check_delay(delay)
        state = "scheduled"
    codec = codecs.get(queue, _JSON)
    if isinstance(requests, list | tuple):
        listed = requests
    else:
        if isinstance(requests, str | bytes | bytearray | dict) or not isinstance(
            requests, Iterable
        ):
            raise TypeError("requests must be an iterable of requests")
        listed = list(requests)
    keys: list[str | None] = []
    encoded: list[bytes] = []
    for request in listed:
        if key is not None:
            found = key(request)
            keys.append(encode_key(found) if found is not None else None)
        else:
            keys.append(None)
        encoded.append(codec.encode(request))
    return Enqueue(keys, encoded, state, wait, checked_priority, hold, time.time(), checked_group)


def enqueue_rows(
    insert: Callable[[list[tuple[str | None, bytes]]], Iterable[tuple[int, str | None]]],
    holders: Callable[[list[str]], dict[str, int]],
    keys: Sequence[str | None],
    requests: Sequence[bytes],
    what: str,
) -> list[int]:
    """Insert requests with their keys; their ids in order, the holder's for a taken key.

    ``insert`` writes (key, request) pairs in order, leaving out each whose key is taken,
    and returns (id, key) of the rows it wrote, their ids increasing in its order.
    ``holders`` gives the holder's id of each key it finds taken: its live row, else the
    latest held. A key met again in the same call gets the id of its first. A holder can
    end between the insert that met it and the look for it: then insert again.
    """
    first: dict[str, int] = {}
    pending: list[int] = []
    for position, key in enumerate(keys):
        if key is None:
            pending.append(position)
        elif key not in first:
            first[key] = position
            pending.append(position)
    ids = [0] * len(keys)
    for _ in range(10):
        written = list(insert([(keys[i], requests[i]) for i in pending]))
        new_keys = {key for _, key in written if key is not None}
        taken = [i for i in pending if keys[i] is not None and keys[i] not in new_keys]
        inserted = [i for i in pending if keys[i] is None or keys[i] in new_keys]
        if len(inserted) != len(written):
            raise StoreError(f"an insert wrote {len(written)} rows of {len(inserted)}")
        for position, (request_id, _) in zip(inserted, sorted(written), strict=True):
            ids[position] = request_id
        found = holders([k for i in taken if (k := keys[i]) is not None]) if taken else {}
        pending = []
        for position in taken:
            holder = found.get(keys[position])  # type: ignore[arg-type]
            if holder is None:
                pending.append(position)
            else:
                ids[position] = holder
        if not pending:
            break
    else:
        raise StoreError(f"keys of {what} kept changing hands; try again")
    for position, key in enumerate(keys):
        if key is not None:
            ids[position] = ids[first[key]]
    return ids


def seconds(name: str, value: object, *, allow_zero: bool = False) -> float:
    """A store's option in seconds, checked: a finite number, > 0 (or >= 0)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds")
    if not (value >= 0 if allow_zero else value > 0):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}")
    if value == math.inf:
        raise ValueError(f"{name} must be finite")
    return float(value)


# -- What a session does besides batches, written once too


def lookup(d: Dialect, queue: str, id_or_key: object) -> Row | None:
    """The queue's row of an id, or of a key (its live row first, else its latest)."""
    sql = d.statements
    if isinstance(id_or_key, int) and not isinstance(id_or_key, bool):
        if not 0 < id_or_key <= MAX_ID:
            return None
        found = d.execute(sql.row_by_id, (queue, id_or_key))
    else:
        found = d.execute(sql.row_by_key, (queue, encode_key(id_or_key)))
    row = found.fetchone()
    return Row(*row) if row is not None else None


def cancel(d: Dialect, queue: str, id_or_key: object) -> tuple[bool, int | None]:
    """Cancel a live request: at once unless it runs, else ask its owner.

    Returns whether a live request was found, and its id.
    """
    x, sql = d.execute, d.statements
    d.begin()
    try:
        if isinstance(id_or_key, int) and not isinstance(id_or_key, bool):
            if not 0 < id_or_key <= MAX_ID:
                d.commit()
                return False, None
            row = x(sql.live_by_id, (queue, id_or_key)).fetchone()
        else:
            row = x(sql.live_by_key, (queue, encode_key(id_or_key))).fetchone()
        if row is None:
            d.commit()
            return False, None
        request_id, state = row
        if state == "running":
            x(sql.ask_cancel, (request_id,))
        else:
            x(sql.cancel_now, (d.now()[0], request_id))
        d.commit()
    except BaseException:
        d.rollback()
        raise
    return True, request_id


def counts(d: Dialect, queue: str) -> dict[str, int]:
    """The queue's rows by state; "claimed" are running rows whose attempt has not started;
    "paused": 1 if the queue is paused, else 0; "limited": the ready rows due that wait
    only for their group's limit, under the limits the queue's last batch stored (see
    BatchResult.limited; 0 without limits); and "rescued_owner_died",
    "rescued_lease_lapsed": the queue's rescues so far, by reason."""
    found = dict.fromkeys(COUNTED, 0)
    found["paused"] = 0
    rescued = {f"rescued_{reason}": 0 for reason in RESCUE_REASONS}
    for state, count in d.execute(d.statements.counts, (queue, queue, queue)):
        if state.startswith("rescued_"):
            rescued[state] = int(count)
        else:
            found[state] = int(count)
    found["limited"] = limited_now(d, queue)
    found.update(rescued)
    return found


@attrs.frozen
class QueueReport:
    """One queue as ``python -m tickler inspect`` shows it."""

    counts: dict[str, int]
    """Rows by state, as Session.statistics() counts them."""
    failures: list[tuple[Any, ...]]
    """The latest failed rows: (id, attempts, error_type, error_message)."""
    paused: bool = False
    """Whether the queue is paused."""
    limits: dict[str, GroupLimit] | None = None
    """The limits the queue's last batch stored, if any."""
    groups: list[tuple[str, dict[str, int]]] = attrs.Factory(list)
    """The busiest groups: (group, its rows by state of COUNTED_LIVE), the most running
    (or claimed) first, then the most of the other live states."""
    rescues: dict[str, int] = attrs.Factory(dict)
    """The queue's rescues so far by reason (RESCUE_REASONS), each reason given; empty for
    a schema that does not count them."""


# Every queue the store knows, by name: those with rows, each found by one probe of
# tickler_by_state (a loose index scan), and those with a row in tickler_queues (paused,
# resumed or limited once).
KNOWN_QUEUES = (
    "WITH RECURSIVE q(name) AS ("
    " SELECT min(queue) FROM tickler_requests"
    " UNION ALL SELECT (SELECT min(queue) FROM tickler_requests WHERE queue > q.name)"
    " FROM q WHERE q.name IS NOT NULL)"
    " SELECT name FROM q WHERE name IS NOT NULL UNION SELECT queue FROM tickler_queues"
)
# Every queue's paused flag, for report().
PAUSED_QUEUES = "SELECT queue, paused FROM tickler_queues"
# Every queue's limits, for report().
QUEUE_LIMITS = "SELECT queue, limits FROM tickler_queues WHERE limits IS NOT NULL"
# Every queue's rescues, for report().
QUEUE_RESCUES = "SELECT queue, reason, count FROM tickler_rescues"
# How many groups report() shows.
BUSIEST_GROUPS = 5


def busiest_groups(mark: str, live: str) -> str:
    """Statements.busiest_groups in a store's words: its placeholder ``mark``, and
    ``live``, its WHERE term for the live rows."""
    counts = ", ".join(
        f"count(CASE WHEN {COUNTED_STATE} = '{state}' THEN 1 END)" for state in COUNTED_LIVE
    )
    return (
        f"SELECT group_name, {counts} FROM tickler_requests"  # noqa: S608 (constants only)
        f" WHERE queue = {mark} AND group_name IS NOT NULL AND {live} GROUP BY group_name"
        " ORDER BY count(CASE WHEN state = 'running' THEN 1 END) DESC,"
        f" count(CASE WHEN state <> 'running' THEN 1 END) DESC, group_name LIMIT {mark}"
    )


def report(
    execute: Callable[[str, Any], Iterable[Sequence[Any]]],
    failures: str,
    latest: int,
    *,
    paused: bool = True,
    groups: str | None = None,
    rescues: bool = False,
) -> dict[str, QueueReport]:
    """Every queue's counts and latest failures, by queue name, and whether it is paused
    (a paused queue without rows too), its limits and its busiest groups.

    ``failures`` is a statement taking (queue, limit), in the style of ``execute``.
    ``paused``: whether the schema has tickler_queues (an older one has none).
    ``groups``: a statement of Statements.busiest_groups' kind, or None for a schema
    without groups.
    """
    by_queue: dict[str, dict[str, int]] = {}
    every_count = (
        f"SELECT queue, {COUNTED_STATE} AS s, count(*) FROM tickler_requests GROUP BY queue, s"  # noqa: S608 (constants only)
    )
    for queue, state, count in execute(every_count, ()):
        by_queue.setdefault(queue, dict.fromkeys(COUNTED, 0))[state] = count
    flags: dict[str, bool] = {}
    if paused:
        flags = {queue: bool(flag) for queue, flag in execute(PAUSED_QUEUES, ())}
        for queue, flag in flags.items():
            if flag:
                by_queue.setdefault(queue, dict.fromkeys(COUNTED, 0))
    limits: dict[str, dict[str, GroupLimit]] = {}
    if groups is not None:
        for queue, text in execute(QUEUE_LIMITS, ()):
            parsed = parse_limits(text)
            if parsed:
                limits[queue] = parsed
                by_queue.setdefault(queue, dict.fromkeys(COUNTED, 0))
    rescued: dict[str, dict[str, int]] = {}
    if rescues:
        for queue, reason, count in execute(QUEUE_RESCUES, ()):
            by_reason = rescued.setdefault(queue, dict.fromkeys(RESCUE_REASONS, 0))
            by_reason[str(reason)] = int(count)
            by_queue.setdefault(queue, dict.fromkeys(COUNTED, 0))
    return {
        queue: QueueReport(
            found,
            [(*row,) for row in execute(failures, (queue, latest))],
            flags.get(queue, False),
            limits.get(queue),
            []
            if groups is None
            else [
                (str(g), dict(zip(COUNTED_LIVE, map(int, by_state), strict=True)))
                for g, *by_state in execute(groups, (queue, BUSIEST_GROUPS))
            ],
            rescued.get(queue, dict.fromkeys(RESCUE_REASONS, 0)) if rescues else {},
        )
        for queue, found in sorted(by_queue.items())
    }


# -- Per-group limits: the claim of a batch with Batch.limits, and its counts

# (concurrency, rate, per) by group name, "*" for the groups not named.
Limits = Mapping[str, GroupLimit]
# What Dialect.due_and_live answers, read by calling: (next due time, live, paused).
DueAndLive = Callable[[], tuple[float | None, int, bool]]
# Dialect.claim_by_groups.
ClaimByGroups = Callable[
    [str, str, float, float, int, Limits, int],
    Callable[[], tuple[list[Claimed], int, list[str], int, tuple[float | None, int, bool]]],
]

# Besides the rows a limited claim asks for, how many more its first look reads in claim
# order, whatever their group: past that many rows of groups at their limit, the claim
# looks group by group instead, so that it never reads a blocked group's backlog.
CHUNK_EXTRA = 64
# BatchResult.limited is counted exactly up to this many rows; a larger count is made
# again by each session at most once every LIMITED_EVERY seconds (of the store's clock),
# and no sooner than LIMITED_SPACING times what its last such count took after it: the
# session reports its last count in between.
LIMITED_EXACT = 100
LIMITED_EVERY = 1.0
LIMITED_SPACING = 50.0


@attrs.define
class LimitedMemo:
    """What one session's limited claims of one queue remember from one to the next."""

    groups: int | None = None
    """How many groups had ready rows at the last claim that looked group by group."""
    counted: int = 0
    """The last full count of BatchResult.limited past LIMITED_EXACT."""
    counted_at: float = -math.inf
    """When it was made (the store's clock)."""
    took: float = 0.0
    """The seconds it took."""


def normal_limits(limits: Mapping[str, Sequence[Any]]) -> dict[str, GroupLimit]:
    """Batch.limits (or limits read back as lists) as a dict of GroupLimit values."""
    return {
        str(group): GroupLimit(
            None if c is None else int(c),
            None if r is None else int(r),
            float(per),
        )
        for group, (c, r, per) in limits.items()
    }


def limits_text(limits: Limits) -> str:
    """The JSON text tickler_queues.limits holds: {group: [concurrency, rate, per]}."""
    return json.dumps(
        {group: list(limit) for group, limit in limits.items()},
        sort_keys=True,
        separators=(",", ":"),
    )


def parse_limits(text: str | None) -> dict[str, GroupLimit] | None:
    """The limits of tickler_queues.limits; None for none, or for text this cannot read."""
    if not text:
        return None
    try:
        found = json.loads(text)
        return normal_limits(found)
    except (ValueError, TypeError, AttributeError):
        return None


def write_limits(d: Dialect, queue: str, limits: Limits) -> None:
    """Keep the batch's limits in tickler_queues, when they differ from what this session
    wrote last."""
    text = limits_text(limits)
    if d.limits_written.get(queue) != text:
        d.execute(d.statements.set_limits, (queue, text))
        d.limits_written[queue] = text


@attrs.define
class _Slots:
    """What each group holds of its limits, at one time: its running rows and its starts."""

    limits: Limits
    now: float
    running: dict[str, int]
    starts: dict[str, list[float]]

    def limit_of(self, group: str) -> GroupLimit | None:
        found = self.limits.get(group)
        return found if found is not None else self.limits.get("*")

    def room(self, group: str) -> int | None:
        """How many more attempts of the group may start now; None: no bound."""
        limit = self.limit_of(group)
        if limit is None:
            return None
        concurrency, rate, per = limit
        rooms = []
        if concurrency is not None:
            rooms.append(concurrency - self.running.get(group, 0))
        if rate is not None:
            since = self.now - per
            rooms.append(rate - sum(1 for t in self.starts.get(group, ()) if t > since))
        return max(0, min(rooms)) if rooms else None

    def rated(self, group: str) -> bool:
        limit = self.limit_of(group)
        return limit is not None and limit.rate is not None

    def take(self, group: str) -> None:
        self.running[group] = self.running.get(group, 0) + 1
        if self.rated(group):
            self.starts.setdefault(group, []).append(self.now)

    def copy(self) -> _Slots:
        return _Slots(
            self.limits,
            self.now,
            dict(self.running),
            {group: list(times) for group, times in self.starts.items()},
        )


def _window(limits: Limits) -> float:
    """The longest window of the rate limits; 0.0 without any."""
    return max((per for _, rate, per in limits.values() if rate is not None), default=0.0)


def _slots(d: Dialect, queue: str, limits: Limits, now: float) -> Callable[[], _Slots]:
    """Ask for each group's running rows (unexpired leases) and starts within the longest
    window; read by calling."""
    x, sql = d.execute, d.statements
    running_cursor = x(sql.running_groups, (queue, now))
    window = _window(limits)
    starts_cursor = x(sql.starts_since, (queue, now - window)) if window > 0 else None

    def read() -> _Slots:
        running = {group: int(n) for group, n in running_cursor}
        starts: dict[str, list[float]] = {}
        for group, started_at in starts_cursor or ():
            starts.setdefault(group, []).append(float(started_at))
        return _Slots(limits, now, running, starts)

    return read


def _claim_key(row: tuple[Any, ...]) -> tuple[int, float, int]:
    return -row[1], row[2], row[0]


def _rooms(slots: _Slots, limit: int) -> tuple[list[tuple[str, int]], int]:
    """How many rows of each group a claim of ``limit`` may take: of each group that runs,
    started or is named in the limits, and of every other group."""
    groups = set(slots.running) | set(slots.starts)
    groups.update(group for group in slots.limits if group != "*")
    rooms = []
    for group in sorted(groups):
        room = slots.room(group)
        rooms.append((group, limit if room is None else min(room, limit)))
    bounds = [limit]
    default = slots.limits.get("*")
    if default is not None:
        bounds += [bound for bound in (default.concurrency, default.rate) if bound is not None]
    return rooms, max(0, min(bounds))


def _walk(
    candidates: list[tuple[Any, ...]], slots: _Slots, limit: int
) -> list[tuple[int, str | None]]:
    """Up to ``limit`` of the candidates, in claim order, skipping each whose group has no
    room left in ``slots`` (which it takes from): (id, group) each."""
    candidates.sort(key=_claim_key)
    picked: list[tuple[int, str | None]] = []
    seen: set[int] = set()
    for request_id, _, _, group in candidates:
        if len(picked) >= limit:
            break
        if request_id in seen:
            continue
        seen.add(request_id)
        if group is not None:
            room = slots.room(group)
            if room is not None and room <= 0:
                continue
            slots.take(group)
        picked.append((request_id, group))
    return picked


def claim_limited(
    d: Dialect, queue: str, owner: str, lease: float, limit: int, limits: Limits, now: float
) -> tuple[Callable[[], tuple[list[Claimed], int]], DueAndLive | None]:
    """Claim up to ``limit`` rows as Dialect.claim does, but for the groups at their limit
    (see Batch.limits); read by calling (as the claim's rows are read, see
    Dialect.reads_after_commit): the rows claimed, and how many ready rows wait for their
    group's limit after the claim (BatchResult.limited, see _limited); and None.

    Every process's limited claims of the queue take turns (Dialect.lock_limited, which
    the batch took first); ``now`` is the batch's time, read once it holds its turn, so
    that each claim of the queue runs at a time past the starts its turn's predecessors
    recorded. The claim counts each group's running rows whose lease has not run out and
    its recorded starts within its window, then walks the candidates in claim order,
    skipping a row whose group has no room left. The candidates come one of two ways. In
    claim order: the first ``limit`` + CHUNK_EXTRA ready rows (with the lapsed leases),
    enough unless groups at their limit hold as many rows in front. Or group by group:
    every group that has ready rows, found one index probe each with its first row, and
    for each with room its first rows, as many as it has room for; and the rows of no
    group. The claim looks in claim order first, then group by group if that fell short;
    it looks group by group at once when the session's last claim of the queue found no
    more groups than rows the first look reads (then that look costs no less), and then,
    where that reads few rows, asks for each group's first rows with the counts, as many
    as its limits could ever let start at once, before its room is known. No backlog of a
    blocked group is read past those rows. The start of each claimed row of a rate-limited
    group is recorded (_claim deleted the starts older than the longest window). The statements
    are asked in as few round trips as their answers allow: a store that pipelines them
    (PostgreSQL) waits for the server once or twice before the claim, which goes with the
    batch's commit (or, where it can, all in one statement: see _claim_at_once).
    """
    x, sql = d.execute, d.statements
    memo = d.limited_memo.setdefault(queue, LimitedMemo())
    size = limit + CHUNK_EXTRA
    seen = memo.groups if memo.groups is not None else size + 1  # groups, at the last claim
    by_groups = seen <= size
    # The most rows of each group the claim could take, whatever runs: where few, they are
    # asked for with the rest, before the groups' rooms are known.
    most, most_default = _rooms(_Slots(limits, now, {}, {}), limit)
    early = by_groups and seen * most_default + sum(room for _, room in most) <= 2 * size
    # Asked all at once, before any answer is read (one round trip where pipelined).
    paused_cursor = x(sql.paused, (queue,))
    slots_read = _slots(d, queue, limits, now)
    expired_cursor = x(sql.expired_rows, (queue, now, owner, limit))
    ungrouped_cursor = x(sql.ungrouped_ready, (queue, now, limit)) if by_groups else None
    chunk_read = None if by_groups else d.ready_chunk(queue, now, size)
    found_read = d.group_candidates(queue, now, most, most_default) if early else None
    paused = paused_cursor.fetchone()
    base = slots_read()
    expired = [tuple(row) for row in expired_cursor]
    ungrouped = [tuple(row) for row in ungrouped_cursor or ()]
    chunk = None if chunk_read is None else [tuple(row) for row in chunk_read()]
    if paused is not None and paused[0]:
        return (lambda: ([], 0)), None

    picked: list[tuple[int, str | None]] = []
    slots = base.copy()
    if chunk is not None:
        picked = _walk(expired + chunk, slots, limit)
        if len(picked) < limit and len(chunk) >= size:
            # Groups at their limit fill the first rows: look group by group.
            by_groups, chunk, slots = True, None, base.copy()
            ungrouped = [tuple(row) for row in x(sql.ungrouped_ready, (queue, now, limit))]
    if by_groups:
        if found_read is None:
            rooms, default_room = _rooms(slots, limit)
            found_read = d.group_candidates(queue, now, rooms, default_room)
        found = [tuple(row) for row in found_read()]
        memo.groups = len({row[3] for row in found})
        picked = _walk(expired + ungrouped + [r for r in found if r[2] <= now], slots, limit)
    # Every due ready row was read (the first look did not fill up): the rows held back are
    # counted from it; else asked for after the claim, with it.
    whole = chunk is not None and len(chunk) < size
    rated = sorted({g for _, g in picked if g is not None and slots.rated(g)})
    claim_read = d.claim_picked(queue, owner, now + lease, now, picked, rated) if picked else None
    also = {g for _, g in picked if g is not None}
    limited = None if whole else _limited(d, queue, slots, also)

    def read() -> tuple[list[Claimed], int]:
        nonlocal slots, limited
        rows: list[Claimed] = [] if claim_read is None else claim_read()
        taken = {row[0] for row in rows}
        if len(rows) < len(picked):  # (a row cancelled in between)
            slots = base.copy()
            for group in [g for i, g in picked if i in taken and g is not None]:
                slots.take(group)
            if limited is not None:
                limited()  # (read: no statement is left with rows to give)
                limited = _limited(d, queue, slots, also)
        if limited is not None:
            return rows, limited()
        assert chunk is not None
        return rows, sum(
            1
            for request_id, _, _, group in chunk
            if group is not None and request_id not in taken and slots.room(group) == 0
        )

    return read, None


def _claim_at_once(
    d: Dialect, queue: str, owner: str, lease: float, limit: int, limits: Limits, now: float
) -> tuple[Callable[[], tuple[list[Claimed], int]], DueAndLive] | None:
    """claim_limited's claim group by group in one statement (Dialect.claim_by_groups), where
    the store can and claim_limited would look group by group at once (the session's last
    claim found few groups), which goes with the batch's commit: no round trip of its own.
    Read as claim_limited's; with it, what Dialect.due_and_live answers, read once the
    claim's rows are. None where it does not claim so."""
    memo = d.limited_memo.setdefault(queue, LimitedMemo())
    claim_by_groups = d.claim_by_groups
    if claim_by_groups is None or memo.groups is None or memo.groups > limit + CHUNK_EXTRA:
        return None
    # serves: pg drain, grouped: reads, walk and claim in one statement.
    at_once = claim_by_groups(queue, owner, now + lease, now, limit, limits, LIMITED_EXACT)
    due: list[tuple[float | None, int, bool]] = []

    def read() -> tuple[list[Claimed], int]:
        rows, held, blocked, memo.groups, due_and_live = at_once()
        due.append(due_and_live)
        if held < LIMITED_EXACT:
            return rows, held
        params = {"queue": queue, "groups": d.listed(blocked), "now": now}
        return rows, _counted(d, queue, params, now)

    return read, lambda: due[0]


def _blocked(d: Dialect, queue: str, slots: _Slots, also: set[str]) -> list[str]:
    """The groups at their limit, as ``slots`` has them, of those that run, started, are
    named in the limits or ``also``, or have ready rows (if the default blocks every group)."""
    groups = set(slots.running) | set(slots.starts) | also
    groups.update(group for group in slots.limits if group != "*")
    default = slots.limits.get("*")
    if default is not None and (default.concurrency == 0 or default.rate == 0):
        # Every group not named is blocked, with rows or not: ask which have rows.
        groups.update(group for (group,) in d.execute(d.statements.ready_groups, (queue, queue)))
    return sorted(group for group in groups if slots.room(group) == 0)


def _limited(d: Dialect, queue: str, slots: _Slots, also: set[str]) -> Callable[[], int]:
    """Ask how many due ready rows wait only for their group's limit, as ``slots`` has
    them; read by calling.

    Counted exactly up to LIMITED_EXACT rows; past that many, the session counts them all
    at most once every LIMITED_EVERY seconds (and LIMITED_SPACING times what its last
    count took), and gives its last such count in between.
    """
    x, sql = d.execute, d.statements
    blocked = _blocked(d, queue, slots, also)
    if not blocked:
        return lambda: 0
    params = {"queue": queue, "groups": d.listed(blocked), "now": slots.now}
    upto = x(sql.limited_upto, {**params, "cap": LIMITED_EXACT})

    def read() -> int:
        (count,) = upto.fetchone()
        if count < LIMITED_EXACT:
            return int(count)
        return _counted(d, queue, params, slots.now)

    return read


def _counted(d: Dialect, queue: str, params: dict[str, Any], now: float) -> int:
    """The rows held back past LIMITED_EXACT (``params`` as limited_count takes them): counted
    in full, or the session's last full count while it is recent (see _limited)."""
    memo = d.limited_memo.setdefault(queue, LimitedMemo())
    spacing = max(LIMITED_EVERY, LIMITED_SPACING * memo.took)
    if memo.counted < LIMITED_EXACT or now - memo.counted_at >= spacing:
        started = time.perf_counter()
        (count,) = d.execute(d.statements.limited_count, params).fetchone()
        memo.took = time.perf_counter() - started
        memo.counted, memo.counted_at = int(count), now
    return memo.counted


def limited_now(d: Dialect, queue: str) -> int:
    """BatchResult.limited as of now, with the limits the queue's last batch stored (0 if
    none), counted in full."""
    row = d.execute(d.statements.limits_of, (queue,)).fetchone()
    limits = parse_limits(row[0]) if row is not None else None
    if not limits:
        return 0
    now = d.now()[0]
    blocked = _blocked(d, queue, _slots(d, queue, limits, now)(), set())
    if not blocked:
        return 0
    params = {"queue": queue, "groups": d.listed(blocked), "now": now}
    (count,) = d.execute(d.statements.limited_count, params).fetchone()
    return int(count)
