"""The transaction every SQL store runs per batch, written once over a Dialect.

A store's session is its own :class:`Dialect`: it writes its own SQL, in its
own placeholder style, and says how to begin, commit, claim and the rest.
What the dialects share is this script, the statements' order and
parameters (:class:`Statements`), and SQL text without placeholders: the
SET clause of each outcome and the lists of states. Connection handling
(a pipeline, reconnects) stays with each store, around :func:`run_batch`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from operator import itemgetter
from typing import Any, Protocol

import attrs

from .._codec import Codec, JsonCodec, check_queue_name, encode_key
from .._exceptions import StoreError
from ._seam import Batch, BatchResult, Claimed, Row

# Live states hold their key; ready states may be claimed once run_at has come.
LIVE = ("queued", "scheduled", "running", "retrying")
FINAL = ("succeeded", "failed", "cancelled")
# What statistics() counts: the states, with the running rows claimed ahead
# of a free slot (started_at still NULL) on their own.
COUNTED = ("queued", "scheduled", "claimed", "running", "retrying", *FINAL)
# The state statistics() counts a row under, as an SQL expression.
COUNTED_STATE = "CASE WHEN state = 'running' AND started_at IS NULL THEN 'claimed' ELSE state END"

# What each outcome sets, from the columns of a row v of its values: column1
# is the id, then the outcome's values, then {now}, the transaction's time.
# Every finished_at is that time, taken once the write lock is held, so that
# rows become final in the order of finished_at (see Batch.finished_since).
SETS = {
    # Once its cancel was asked for, a request ends CANCELLED, even if its
    # handler returned (or failed) before the cancel reached it.
    "succeeded": (
        "state = CASE WHEN cancel_requested THEN 'cancelled' ELSE 'succeeded' END,"
        " result = CASE WHEN cancel_requested THEN NULL ELSE v.column2 END,"
        " finished_at = {now}, started_at = coalesce(started_at, {now})"
    ),
    # A request whose cancel was asked for is never retried nor handed back.
    "retrying": (
        "state = CASE WHEN cancel_requested THEN 'cancelled' ELSE 'retrying' END,"
        " finished_at = CASE WHEN cancel_requested THEN {now} END,"
        " run_at = v.column2, error_type = v.column3,"
        " error_message = v.column4, error_traceback = v.column5,"
        " started_at = coalesce(started_at, {now})"
    ),
    "failed": (
        "state = CASE WHEN cancel_requested THEN 'cancelled' ELSE 'failed' END,"
        " finished_at = {now}, error_type = v.column3,"
        " error_message = v.column4, error_traceback = v.column5,"
        " started_at = coalesce(started_at, {now})"
    ),
    "cancelled": (
        "state = 'cancelled', finished_at = {now}, started_at = coalesce(started_at, {now})"
    ),
    "handed_back": (
        "state = CASE WHEN cancel_requested THEN 'cancelled' ELSE 'queued' END,"
        " finished_at = CASE WHEN cancel_requested THEN {now} END, run_at = v.column2,"
        " started_at = coalesce(started_at, {now})"
    ),
    # Claimed but never started: handed back, and the claim's attempt undone.
    "returned": (
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

INSERT_COLUMNS = "INSERT INTO tickler_requests (queue, key, state, request, run_at, enqueued_at)"

# Rows without a key go many to an INSERT, at most this many.
ROWS_PER_STATEMENT = 150
# Final rows a batch deletes at most.
PRUNE_BATCH = 1000

# The order of claimed rows: as they fell due, then as they were enqueued.
_DUE_THEN_ID = itemgetter(5, 0)


@attrs.frozen
class Statements:
    """The statements the script runs as they are, each written in its dialect's style.

    Each takes its parameters positionally, in the order its comment gives.
    """

    insert: str
    """(queue, key, state, request, run_at, enqueued_at): RETURNING id; no row if the
    key is live."""
    live_id_of_key: str
    """(queue, key): the id of the key's live row."""
    renew: str
    """(lease_until, queue, owner): every running lease of owner's."""
    mine: str
    """(queue, owner): (id, cancel_requested) of owner's running rows."""
    end_cancelled_orphans: str
    """(now, queue, now, owner): rows whose cancel was asked for and whose other owner's
    lease lapsed end CANCELLED; nobody claims them again. The owner's own are left to
    its next look, which withdraws the attempt."""
    recent: str
    """(queue, since): ids of the queue's rows final since then."""
    prune: str
    """(queue, cutoff, limit): delete the queue's rows final before cutoff. Each queue's
    retention deletes its own rows only: queues of one store may keep them for different
    times."""
    has: str
    """(id,): a row, if the id has one."""
    row_by_id: str
    """(queue, id): the Row."""
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
    """(queue,): (state as COUNTED_STATE, count) for each state the queue has."""


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

    def insert_rows(
        self, queue: str, entries: Sequence[tuple[Any, ...]], now: float
    ) -> Iterable[int]:
        """Insert keyless entries (None, state, request, run_at, ...) in one statement;
        their ids, in their order."""
        ...

    def write_outcomes(
        self, owner: str, outcomes: Sequence[tuple[str, int, tuple[Any, ...]]], now: float
    ) -> list[str | None]:
        """Each outcome (see run_batch) only while owner holds its lease: the state it
        wrote, or None where the lease was gone."""
        ...

    def mark_started(self, owner: str, ids: Sequence[int], now: float) -> None:
        """Write the start of the attempts ``ids``, which run under ``owner``'s lease."""
        ...

    def claim(
        self, queue: str, owner: str, now: float, lease_until: float, limit: int
    ) -> Callable[[], list[Claimed]]:
        """Claim up to ``limit`` ready rows and rows whose lease expired (not owner's own,
        not asked to cancel), in the order they fell due; the answer is read by calling."""
        ...

    def due_and_live(self, queue: str) -> Callable[[], tuple[float | None, int]]:
        """Ask when the next ready row falls due, and whether anything of the queue is
        live (1 or 0); the answer is read by calling."""
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


def run_batch(
    d: Dialect, queue: str, owner: str, lease: float, retention: float, batch: Batch
) -> BatchResult:
    """Write and ask everything in ``batch`` in one transaction.

    Outcomes are ``("succeeded", id, (result, finished_at))``,
    ``("retrying", id, (run_at, type, message, traceback))``,
    ``("failed", id, (finished_at, type, message, traceback))``,
    ``("cancelled", id, (finished_at,))``, ``("handed_back", id, (run_at,))`` and
    ``("returned", id, (run_at,))`` (claimed, never started);
    each applies only while ``owner`` still holds the request's lease.

    With ``batch.isolate``, each insert runs in a savepoint of its own: a
    row whose insert raises is rolled back alone, reported in
    ``BatchResult.refused`` and entered as (0, False) in ``inserted``,
    and the rest of the batch commits. Without it, any error fails the
    whole batch, and nothing of it is written.
    """
    x = d.execute
    sql = d.statements
    result = BatchResult()
    d.begin()
    try:
        now, shift = d.now()
        result.now, result.shift = now, shift
        inserts, outcomes = batch.inserts, batch.outcomes
        if shift:
            # The loop's times (an enqueue's run_at, an outcome's) are this
            # process's time.time(): moved onto the store's clock.
            inserts = [(e[0], e[1], e[2], e[3] + shift, *e[4:]) for e in inserts]
            outcomes = [_shifted(outcome, shift) for outcome in outcomes]
        if batch.isolate:
            result.inserted = _insert_isolated(d, queue, inserts, now, result.refused)
        else:
            result.inserted = _insert(d, queue, inserts, now)
        if batch.started:
            d.mark_started(owner, batch.started, now)
        result.applied = d.write_outcomes(owner, outcomes, now)
        if batch.renew:
            x(sql.renew, (now + lease, queue, owner))
            result.mine = {row[0]: bool(row[1]) for row in x(sql.mine, (queue, owner))}
        if batch.claim or batch.renew:
            x(sql.end_cancelled_orphans, (now, queue, now, owner))
        claimed = d.claim(queue, owner, now, now + lease, batch.claim) if batch.claim else None
        # Asked before the claim's rows are read: a server answers both, and
        # with reads_after_commit the COMMIT, in one round trip.
        due_and_live = d.due_and_live(queue)

        def read() -> None:
            if claimed is not None:
                rows = claimed()
                rows.sort(key=_DUE_THEN_ID)
                result.claimed = rows
            result.next_due, result.live = due_and_live()

        if not d.reads_after_commit:
            read()
        if batch.watched:
            result.finals = d.finals(batch.watched)
            found = {row.id for row in result.finals}
            result.missing = [
                i for i in batch.watched if i not in found and x(sql.has, (i,)).fetchone() is None
            ]
        cutoff = now - retention
        if batch.finished_since is not None:
            result.recent = [row[0] for row in x(sql.recent, (queue, batch.finished_since))]
            # What this look reports as recent is read at the next look:
            # keep it until then, whatever the retention.
            cutoff = min(cutoff, batch.finished_since)
        if batch.prune:
            result.pruned = x(sql.prune, (queue, cutoff, PRUNE_BATCH)).rowcount
        if batch.inserts:
            d.notify(queue)  # once per batch, never per row
        d.commit()
        if d.reads_after_commit:
            read()
    except BaseException:
        d.rollback()
        raise
    return result


def _shifted(
    outcome: tuple[str, int, tuple[Any, ...]], shift: float
) -> tuple[str, int, tuple[Any, ...]]:
    """An outcome whose time (finished_at, or run_at) is moved by ``shift``."""
    kind, request_id, values = outcome
    at = 1 if kind == "succeeded" else 0  # (result, finished_at); the others start with it
    return kind, request_id, (*values[:at], values[at] + shift, *values[at + 1 :])


def _insert(
    d: Dialect, queue: str, inserts: Sequence[tuple[Any, ...]], now: float
) -> list[tuple[int, bool]]:
    """Insert in order; requests without a key many to a statement.

    Each entry starts with (key, state, request, run_at).
    """
    sql = d.statements
    inserted: list[tuple[int, bool]] = []
    plain: list[tuple[Any, ...]] = []

    def flush() -> None:
        for start in range(0, len(plain), ROWS_PER_STATEMENT):
            ids = d.insert_rows(queue, plain[start : start + ROWS_PER_STATEMENT], now)
            inserted.extend((request_id, True) for request_id in ids)
        plain.clear()

    for entry in inserts:
        key = entry[0]
        if key is None:
            plain.append(entry)
            continue
        flush()
        params = (queue, key, entry[1], entry[2], entry[3], now)
        inserted.append(insert_keyed(d.execute, sql.insert, sql.live_id_of_key, key, params))
    flush()
    return inserted


# A savepoint per row of an isolated batch; the same words in every dialect.
_SAVEPOINT = "SAVEPOINT tickler_row"
_ROLLBACK_TO_SAVEPOINT = "ROLLBACK TO SAVEPOINT tickler_row"
_RELEASE_SAVEPOINT = "RELEASE SAVEPOINT tickler_row"


def _insert_isolated(
    d: Dialect,
    queue: str,
    inserts: Sequence[tuple[Any, ...]],
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


def _one_line(exc: BaseException) -> str:
    """``ExcType: message`` on one line."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def insert_keyed(
    execute: Callable[[str, Any], Any], insert: str, live: str, key: str | None, params: Any
) -> tuple[int, bool]:
    """Insert a request: (its id, True), or (the live one's id, False) if its key is live.

    ``insert`` is a statement of Statements.insert's kind, run with ``params``;
    ``live`` one of Statements.live_id_of_key's, run with (queue, key), the
    queue being the first of ``params``. Under PostgreSQL's READ COMMITTED
    the live row can end between the insert that met it and the select that
    looks for it: then insert again.
    """
    for _ in range(10):
        found = execute(insert, params).fetchone()
        if found is not None:
            return found[0], True
        live_row = execute(live, (params[0], key)).fetchone()
        if live_row is not None:
            return live_row[0], False
    raise StoreError(f"the key {key} of queue {params[0]!r} kept changing hands; try again")


_JSON = JsonCodec()


def prepare_enqueue(
    codecs: dict[str, Codec], queue: str, request: object, key: object, delay: float | None
) -> tuple[str | None, str, bytes, float, float]:
    """What ``enqueue_in`` writes, checked and encoded: (key, state, request, run_at, now).

    The times are this process's clock.
    """
    if not isinstance(queue, str):
        raise TypeError("queue must be a str")
    check_queue_name(queue, "queue")
    key_text = encode_key(key) if key is not None else None
    now = time.time()
    run_at, state = now, "queued"
    if delay is not None:
        run_at += seconds("delay", delay, allow_zero=True)
        state = "scheduled"
    return key_text, state, codecs.get(queue, _JSON).encode(request), run_at, now


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
        if not 0 < id_or_key < 2**63:
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
            if not 0 < id_or_key < 2**63:
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
    """The queue's rows by state; "claimed" are running rows whose attempt has not started."""
    found = dict.fromkeys(COUNTED, 0)
    for state, count in d.execute(d.statements.counts, (queue,)):
        found[state] = count
    return found


@attrs.frozen
class QueueReport:
    """One queue as ``python -m tickler inspect`` shows it."""

    counts: dict[str, int]
    """Rows by state, as Session.statistics() counts them."""
    failures: list[tuple[Any, ...]]
    """The latest failed rows: (id, attempts, error_type, error_message)."""


def report(
    execute: Callable[[str, Any], Iterable[Sequence[Any]]], failures: str, latest: int
) -> dict[str, QueueReport]:
    """Every queue's counts and latest failures, by queue name.

    ``failures`` is a statement taking (queue, limit), in the style of ``execute``.
    """
    by_queue: dict[str, dict[str, int]] = {}
    every_count = (
        f"SELECT queue, {COUNTED_STATE} AS s, count(*) FROM tickler_requests GROUP BY queue, s"  # noqa: S608 (constants only)
    )
    for queue, state, count in execute(every_count, ()):
        by_queue.setdefault(queue, dict.fromkeys(COUNTED, 0))[state] = count
    return {
        queue: QueueReport(found, [(*row,) for row in execute(failures, (queue, latest))])
        for queue, found in sorted(by_queue.items())
    }
