"""The admin API of the SQL stores: ``store.admin()``, which needs no running service.

An :class:`Admin` acts on every queue of a store directly, through a session of its own
(the store's ``connect()``), each call on a worker thread. Its SQL is written here once,
over an :class:`AdminDialect`: the store's session, which says its placeholder, the very
words of its partial index of ready rows. The dialects keep no SQL of the admin's but for
those words; the indexes the admin reads on are each store's own (see the stores'
schemas: tickler_by_state, tickler_by_group, tickler_finished_by_queue), and so is the
counting of the requests finished per minute into tickler_minutes (a trigger; on
PostgreSQL also the outcome statements of the batches).

Cancel and lookup are the service's own (_sql.cancel, _sql.lookup): a running request's
cancel is asked of its owner, whose next look at its leases (within one poll_interval)
withdraws the attempt, on whichever replica runs it.
"""

# Every statement here is built of constant text and the dialect's placeholders alone.
# ruff: noqa: S608

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import attrs
import trio

from .._codec import Codec, JsonCodec, check_group, check_queue_name, encode_key
from .._core import MAX_ID
from .._exceptions import KeyTaken
from .._states import CLAIMED, COUNTED, ENDED, LIVE, READY, RETRYABLE, STATES, sql_in
from ._sql import RESCUE_REASONS, Dialect, cancel, limited_now

_T = TypeVar("_T")

logger = logging.getLogger("tickler")

# The sets of states the admin's SQL names, written in as constants (see _Filter.where).
_LIVE = sql_in(LIVE)
_RETRYABLE = sql_in(RETRYABLE)
_WAITING = sql_in(READY)
_RUNNING = sql_in(["running"])
_IDLE = "state <> 'running'"

# The most rows a page holds.
MAX_LIMIT = 500
# The overview's window: rows finished in the last hour, by minute.
WINDOW = 3600.0
# The overview counts each state exactly up to this many rows; past it, the count is the
# store's estimate (see QueueOverview.estimated), so that a queue of millions of rows costs
# about what one of COUNT_CAP does.
COUNT_CAP = 50_000
# The overview's percentiles read at most this many of the latest rows finished in the
# window, so that a busy queue's overview costs the same as a quiet one's.
PERCENTILE_ROWS = 10_000

# How many times in all the admin runs a transaction of its own that the server ended
# to break a deadlock (see _again_on_deadlock).
DEADLOCK_TRIES = 3

# The columns of an AdminRequest, in the order _request() reads them.
_COLUMNS = (
    "id, queue, key, state, request, priority, group_name, attempts, enqueued_at, run_at,"
    " started_at, finished_at, owner, lease_until, cancel_requested, error_type,"
    " error_message, error_traceback, result"
)


@attrs.frozen
class AdminRequest:
    """One request as the store has it, read by ``store.admin()``."""

    id: int
    queue: str
    key: Any
    """The key as the store keeps it, decoded from its JSON (a tuple key reads as a
    list); None without one."""
    state: str
    request: Any
    """The request, decoded with the queue's codec in this process (JSON by default); its
    bytes if that codec cannot read them."""
    priority: int
    group: str | None
    attempts: int
    enqueued_at: float
    run_at: float
    """When it fell due, or falls due: its enqueue plus its delay, or its next retry."""
    started_at: float | None
    finished_at: float | None
    owner: str | None
    """The service (replica) whose lease it runs under, while it runs."""
    lease_until: float | None
    cancel_requested: bool
    error_type: str | None
    error_message: str | None
    error_traceback: str | None
    """The last failed attempt's error, kept until the next attempt ends; the traceback is
    bounded (see MAX_TRACEBACK_CHARS in the stores' notes)."""
    result: Any
    """The result, decoded; None unless it succeeded."""
    waits_on: list[int] = attrs.Factory(list)
    """The requests it waits on; empty: the stores record no links between requests."""
    waited_by: list[int] = attrs.Factory(list)
    """The requests waiting on it; empty likewise."""


@attrs.frozen
class AdminPage:
    """A page of requests, newest first."""

    rows: list[AdminRequest]
    next: int | None
    """Pass as ``after=`` for the next page; None on the last."""


@attrs.frozen
class QueueOverview:
    """One queue at a glance."""

    queue: str
    counts: dict[str, int]
    """As ``counts(queue)``, but for the states named in ``estimated``."""
    oldest_queued_age: float | None
    """Seconds since the ready request due the longest fell due; None if none is due."""
    running: int
    """Attempts running now, across every replica (claimed ahead, not started, excluded:
    counts["claimed"])."""
    paused: bool
    per_minute: list[tuple[float, int, int]]
    """(minute start, succeeded, failed) for each of the last 60 minutes, the oldest first;
    times are epoch seconds. Exact: each attempt that ended a request SUCCEEDED or FAILED
    is counted in its minute as it ends (a request retried after failing, or deleted
    since, counts still)."""
    wait_p50: float | None
    """From the rows that succeeded or failed in the last hour (their latest
    PERCENTILE_ROWS): seconds between falling due and the last attempt's start."""
    wait_p95: float | None
    run_p50: float | None
    """Likewise, seconds the last attempt ran."""
    run_p95: float | None
    estimated: list[str] = attrs.Factory(list)
    """The states whose count is an estimate: each had more than COUNT_CAP rows, and its
    count is the store's estimate (the planner's, PostgreSQL's; SQLite has none, and gives
    COUNT_CAP), never less than COUNT_CAP. ``counts(queue)`` counts them exactly."""


@attrs.frozen
class Replica:
    """A live replica: a service whose liveness mark the store holds now (see
    docs/failures.md), whether it holds work or not."""

    owner: str
    """The service's id in the store: the owner of the requests it runs."""
    host: str
    """The host of its process, as ``socket.gethostname()`` gave it when the mark was
    taken."""
    pid: int
    """Its process's id on that host."""
    since: float
    """When it took its liveness mark (epoch seconds): its start, or its last new owner
    id (PostgreSQL: or its mark taken again after a server restart)."""
    leased: int = 0
    """How many running requests it holds (claimed ones included); 0 for an idle one."""
    last_renewed: float | None = None
    """When it last renewed its leases (epoch seconds): its latest lease_until less the
    admin's store's ``lease``, which the replicas are assumed to share; None if it holds
    none."""
    lease_until: float | None = None
    """Its latest lease's end; None if it holds none."""
    queues: list[str] = attrs.Factory(list)
    """The queues of its running requests."""


def this_process() -> tuple[str, int]:
    """The host and the id of this process, as a replica's liveness mark records them."""
    return socket.gethostname(), os.getpid()


class AdminDialect(Dialect, Protocol):
    """A store's session as the admin uses it: the batch's Dialect, and a few words."""

    mark: str
    """The placeholder of the session's statements."""
    ready_state: str
    """The WHERE term of the store's partial index of ready rows, in its very words."""

    skip_locked: str
    """The words that make a SELECT lock the rows it gives, passing over those another
    transaction holds, without waiting; empty in a store that locks no rows (its writers
    take turns on the whole store)."""

    def key_taken(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the store refusing a second live row of a key."""
        ...

    def deadlocked(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the server ending this session's transaction to break a
        deadlock (it rolled back, and may run again)."""
        ...

    def estimate(self, sql: str, params: Sequence[Any]) -> int | None:
        """How many rows the store estimates the query gives, without running it; None
        if it cannot tell."""
        ...

    def run_admin(self, call: Callable[..., _T], *args: Any) -> _T:
        """Call ``call(self, *args)``, rolling back after an error (and connecting again
        where the server went away)."""
        ...

    def live_owners(self) -> list[tuple[str, str, int, float]]:
        """(owner, host, pid, since) of each service whose liveness mark the store holds
        now, as recorded with the mark. Reads only."""
        ...

    def close(self) -> None: ...


def _check_queue(queue: object) -> str:
    return check_queue_name(queue, "queue")


def _check_int(value: object, name: str, low: int, high: int, what: str = "") -> int:
    """``value``, an int in ``low``..``high``: the one check of every int the admin takes.

    Raises:
        TypeError: not an int (a bool is not one).
        ValueError: out of range; the message names ``name`` and the range.
    """
    bound = "2**63-1" if high == MAX_ID else str(high)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int{what}, not {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be an int in {low}..{bound}{what}, not {value}")
    return value


def _check_id(value: object, name: str) -> int:
    return _check_int(value, name, 1, MAX_ID, " (a request's id)")


def _check_id_or_key(id_or_key: object) -> None:
    """An int is an id (checked as one); anything else a key."""
    if isinstance(id_or_key, int) and not isinstance(id_or_key, bool):
        _check_id(id_or_key, "id_or_key")
    else:
        _check_key(id_or_key, "id_or_key")


def _check_key(key: object, name: str) -> str:
    try:
        return encode_key(key)
    except TypeError as exc:
        raise TypeError(f"{name}: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


@attrs.frozen
class _Filter:
    state: str | None
    key: str | None
    group: str | None

    @classmethod
    def of(cls, state: object, key: object, group: object) -> _Filter:
        if state is not None and state not in STATES:
            raise ValueError(f"state must be None or one of {', '.join(STATES)}, not {state!r}")
        try:
            checked_group = check_group(group)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"group: {exc}") from None
        return cls(
            state,
            None if key is None else _check_key(key, "key"),
            checked_group,
        )

    def where(self, m: str, queue: str) -> tuple[str, list[Any]]:
        """The WHERE terms (after ``queue = ?``) and all their parameters.

        The state is written in as a constant (one of STATES, checked): a plan made for
        any parameters is then proven to fit a partial index of the store's (PostgreSQL's
        tickler_by_group holds no running rows)."""
        terms = [f"queue = {m}"]
        params: list[Any] = [queue]
        if self.state is not None:
            terms.append(_state_is(self.state))
        if self.key is not None:
            terms.append(f"key = {m}")
            params.append(self.key)
        if self.group is not None:
            terms.append(f"group_name = {m}")
            params.append(self.group)
        return " AND ".join(terms), params


def _state_is(state: str) -> str:
    """``state = '<state>'``, a constant: ``state`` must be one of STATES (written into the
    SQL, it is checked here even though every caller checked it already)."""
    if state not in STATES:
        raise ValueError(f"state must be one of {', '.join(STATES)}, not {state!r}")
    return f"state = '{state}'"


# -- The SQL, run on the worker thread


def _queues(d: AdminDialect) -> list[str]:
    return sorted(str(name) for (name,) in d.execute(d.statements.known_queues, ()))


def _row(d: AdminDialect, queue: str, id_or_key: object) -> tuple[Any, ...] | None:
    m = d.mark
    if isinstance(id_or_key, int) and not isinstance(id_or_key, bool):
        sql = f"SELECT {_COLUMNS} FROM tickler_requests WHERE queue = {m} AND id = {m}"
        found = d.execute(sql, (queue, id_or_key)).fetchone()
    else:
        # The live row first, else the latest (as the service's lookup).
        sql = (
            f"SELECT {_COLUMNS} FROM tickler_requests WHERE queue = {m} AND key = {m}"
            f" ORDER BY CASE WHEN {_LIVE} THEN 0 ELSE 1 END, id DESC LIMIT 1"
        )
        found = d.execute(sql, (queue, _check_key(id_or_key, "id_or_key"))).fetchone()
    return None if found is None else tuple(found)


def _page(d: AdminDialect, queue: str, f: _Filter, after: int | None, limit: int) -> list[Any]:
    """Up to ``limit`` rows, newest first, below ``after``.

    Each state's rows are read newest first on tickler_by_state (queue, state, id), or
    tickler_by_group with a group, or tickler_keys with a key: without a state, one such
    read per state, merged; no read goes past ``limit`` entries of its index.
    """
    m = d.mark
    where, params = f.where(m, queue)
    if after is not None:
        where += f" AND id < {m}"
        params.append(after)
    if f.state is not None or f.key is not None:
        ids = f"SELECT id FROM tickler_requests WHERE {where} ORDER BY id DESC LIMIT {m}"
        params.append(limit)
    else:
        parts = []
        every: list[Any] = []
        for state in STATES:
            parts.append(
                "SELECT id FROM (SELECT id FROM tickler_requests"
                f" WHERE {where} AND {_state_is(state)} ORDER BY id DESC LIMIT {m}) AS s"
            )
            every += [*params, limit]
        ids = f"SELECT id FROM ({' UNION ALL '.join(parts)}) AS u ORDER BY id DESC LIMIT {m}"
        params = [*every, limit]
    sql = f"SELECT {_COLUMNS} FROM tickler_requests WHERE id IN ({ids}) ORDER BY id DESC"
    return [tuple(row) for row in d.execute(sql, params)]


def _count_where(d: AdminDialect, queue: str, f: _Filter) -> int:
    where, params = f.where(d.mark, queue)
    if f.state is None and f.key is None:
        # The running rows and the others apart, each read on an index that holds them
        # (tickler_by_group and tickler_by_state hold no running rows on PostgreSQL).
        sql = (
            f"SELECT (SELECT count(*) FROM tickler_requests WHERE {where} AND {_IDLE})"
            f" + (SELECT count(*) FROM tickler_requests WHERE {where} AND {_RUNNING})"
        )
        params = [*params, *params]
    else:
        sql = f"SELECT count(*) FROM tickler_requests WHERE {where}"
    return int(d.execute(sql, params).fetchone()[0])


def _cancel_where(d: AdminDialect, queue: str, f: _Filter) -> int:
    """Live rows that do not run end CANCELLED; running rows have their cancel asked of
    their owner (those already asked are not counted again).

    The rows are picked by id, those that wait and those that run apart, each read on an
    index that holds them; each is checked again as it is written (see _bulk)."""
    m = d.mark
    where, params = f.where(m, queue)
    sets = (
        "cancel_requested = CASE WHEN state = 'running' THEN TRUE ELSE cancel_requested END,"
        f" finished_at = CASE WHEN state = 'running' THEN finished_at ELSE {m} END,"
        " state = CASE WHEN state = 'running' THEN state ELSE 'cancelled' END"
    )
    check = f"{_LIVE} AND NOT (state = 'running' AND cancel_requested)"
    picks = [
        (f"{where} AND {_WAITING}", params),
        (f"{where} AND {_RUNNING} AND NOT cancel_requested", params),
    ]
    return _bulk(d, sets, check, picks, queue=None)


# What a retry sets ({m}: the time it is due, now), and where it applies: failed or
# cancelled rows queued again, their attempts and error kept. A row of a key is retried
# only if it is the key's latest row and no live row holds the key (the key then becomes
# live again).
_RETRY_SETS = (
    "state = 'queued', run_at = {m}, finished_at = NULL, result = NULL,"
    " cancel_requested = FALSE, owner = NULL, lease_until = NULL"
)
_RETRY_CHECK = (
    f"{_RETRYABLE} AND (key IS NULL OR NOT EXISTS ("
    " SELECT 1 FROM tickler_requests AS h WHERE h.queue = tickler_requests.queue"
    " AND h.key = tickler_requests.key AND h.id <> tickler_requests.id"
    f" AND (h.id > tickler_requests.id OR h.{_LIVE})))"
)


def _retry(d: AdminDialect, queue: str, request_id: int) -> int:
    """0 as well where a request of its key was enqueued while the retry ran (its key is
    live again: the request stays as it was)."""
    m = d.mark
    sql = (
        f"UPDATE tickler_requests SET {_RETRY_SETS.format(m=m)}"
        f" WHERE queue = {m} AND id = {m} AND {_RETRY_CHECK}"
    )
    try:
        return _write(d, sql, lambda now: [now, queue, request_id], queue=queue)
    except Exception as exc:
        if d.key_taken(exc):
            return 0
        raise


def _retry_where(d: AdminDialect, queue: str, f: _Filter) -> int:
    where, params = f.where(d.mark, queue)
    picks = [(f"{where} AND {_RETRYABLE}", params)]
    try:
        return _bulk(d, _RETRY_SETS.format(m=d.mark), _RETRY_CHECK, picks, queue=queue)
    except Exception as exc:
        if d.key_taken(exc):
            raise KeyTaken(
                "a request of the key of one of the requests to retry was enqueued while the"
                " retry ran: nothing was retried; try again"
            ) from None
        raise


def _bulk(
    d: AdminDialect,
    sets: str,
    check: str,
    picks: Sequence[tuple[str, list[Any]]],
    *,
    queue: str | None,
) -> int:
    """A bulk write: SET ``sets`` (its one placeholder: the store's time) on the rows that
    ``picks`` select (each a WHERE and its parameters: the rows are picked by id, each
    pick read on an index of its own), each written only where ``check`` holds as it is
    written; the rows written. With ``queue``, wake its replicas (NOTIFY where the store
    has it).

    It never waits for a row's lock while it holds another's. A replica's batch takes the
    locks of its rows in statements of their own (the attempts started, each kind of
    outcome, the renewal of its leases), in no order the admin could follow, so such a
    wait could close a cycle with it: a deadlock. So one statement writes every row
    picked that no other transaction holds, taking each lock without waiting (the
    dialect's skip_locked); then each row left, held by a batch at that instant, is
    written in a transaction of its own, which waits for that batch alone (a row whose
    write would take a key that another request holds by then is left as it is). A store
    that locks no rows (SQLite) writes them all in the first statement.
    """
    m = d.mark

    def picked(lock: str) -> str:
        return " UNION ALL ".join(
            f"SELECT id FROM (SELECT id FROM tickler_requests WHERE {where}{lock}) AS p{i}"
            for i, (where, _) in enumerate(picks)
        )

    picked_params = [p for _, params in picks for p in params]
    first = f"UPDATE tickler_requests SET {sets} WHERE {check} AND id IN ({picked(d.skip_locked)})"
    left = f"SELECT id FROM tickler_requests WHERE {check} AND id IN ({picked('')}) ORDER BY id"
    one = f"UPDATE tickler_requests SET {sets} WHERE {check} AND id = {m}"

    def write_free() -> tuple[int, list[int]]:
        written = int(d.execute(first, [d.now()[0], *picked_params]).rowcount)
        held = [int(i) for (i,) in d.execute(left, picked_params)] if d.skip_locked else []
        if queue is not None and written:
            d.notify(queue)
        return written, held

    written, held = _transaction(d, write_free)
    for request_id in held:

        def write_one(request_id: int = request_id) -> int:
            count = int(d.execute(one, [d.now()[0], request_id]).rowcount)
            if queue is not None and count:
                d.notify(queue)
            return count

        try:
            written += _transaction(d, write_one)
        except Exception as exc:
            if not d.key_taken(exc):
                raise
    return written


def _write(
    d: AdminDialect, sql: str, params: Callable[[float], list[Any]], *, queue: str | None
) -> int:
    """Run one UPDATE in a transaction of its own, at the store's time; the rows it wrote.
    With ``queue``, wake its replicas (NOTIFY where the store has it)."""

    def write() -> int:
        written = int(d.execute(sql, params(d.now()[0])).rowcount)
        if queue is not None and written:
            d.notify(queue)
        return written

    return _transaction(d, write)


def _transaction(d: AdminDialect, work: Callable[[], _T]) -> _T:
    """``work()`` in a transaction of its own (rolled back if it raises); run again where
    the server ended that transaction to break a deadlock (see _again_on_deadlock)."""

    def once() -> _T:
        d.begin()
        try:
            done = work()
            d.commit()
        except BaseException:
            d.rollback()
            raise
        return done

    return _again_on_deadlock(d, once)


def _again_on_deadlock(d: AdminDialect, call: Callable[[], _T]) -> _T:
    """``call()``, which runs one whole transaction of the admin's; again, up to
    DEADLOCK_TRIES times in all, while the server ends that transaction to break a
    deadlock (it ends one transaction of the cycle, which wrote nothing; the others go
    on). The admin's writes wait for no row while holding another (see _bulk), but a
    write may still wait on another transaction while it holds its row: one that inserts
    the key a retry makes live again, say, while it waits for that row in turn."""
    tries = 1
    while True:
        try:
            return call()
        except Exception as exc:
            if tries >= DEADLOCK_TRIES or not d.deadlocked(exc):
                raise
            logger.warning(
                "the admin's transaction was ended by the server to break a deadlock;"
                " running it again (try %d of %d)",
                tries + 1,
                DEADLOCK_TRIES,
            )
            tries += 1


def _cancel(d: AdminDialect, queue: str, id_or_key: object) -> bool:
    return _again_on_deadlock(d, lambda: cancel(d, queue, id_or_key))[0]


def _set_paused(d: AdminDialect, queue: str, paused: bool) -> bool:
    """Whether the store knew the queue before (see Admin.pause)."""

    def write() -> bool:
        known = queue in _queues(d)
        d.execute(d.statements.set_paused, (queue, paused))
        d.notify(queue)
        return known

    return _transaction(d, write)


def _counts(
    d: AdminDialect, queue: str, cap: int | None = None
) -> tuple[dict[str, int], list[str]]:
    """As _sql.counts, each state counted on tickler_by_state's entries alone, and the
    claimed rows among the running on tickler_running; and the states whose count is an
    estimate.

    With ``cap``, no state's count reads more than ``cap`` + 1 entries: a state with more
    is given the store's estimate (never less than ``cap``), and named as estimated.
    """
    m = d.mark
    found = dict.fromkeys(COUNTED, 0)
    estimated: list[str] = []
    if cap is None:
        sql = f"SELECT state, count(*) FROM tickler_requests WHERE queue = {m} GROUP BY state"
        params: list[Any] = [queue]
    else:
        # (The states are constants: their names are written in.)
        sql = " UNION ALL ".join(
            f"SELECT '{state}', count(*) FROM (SELECT 1 FROM tickler_requests"
            f" WHERE queue = {m} AND state = '{state}' LIMIT {m}) AS c{i}"
            for i, state in enumerate(STATES)
        )
        params = [p for _ in STATES for p in (queue, cap + 1)]
    for state, count in d.execute(sql, params).fetchall():
        found[str(state)] = int(count)
        if cap is not None and count > cap:
            guess = d.estimate(
                f"SELECT 1 FROM tickler_requests WHERE queue = {m} AND state = {m}",
                (queue, state),
            )
            found[str(state)] = max(cap, guess or 0)
            estimated.append(str(state))
    claimed = (
        f"SELECT count(*) FROM tickler_requests WHERE queue = {m} AND state = 'running'"
        " AND started_at IS NULL"
    )
    found[CLAIMED] = int(d.execute(claimed, (queue,)).fetchone()[0])
    found["running"] -= found[CLAIMED]
    flag = d.execute(d.statements.paused, (queue,)).fetchone()
    found["paused"] = int(bool(flag is not None and flag[0]))
    found["limited"] = limited_now(d, queue)
    for reason in RESCUE_REASONS:
        found[f"rescued_{reason}"] = 0
    rescues = f"SELECT reason, count FROM tickler_rescues WHERE queue = {m}"
    for reason, count in d.execute(rescues, (queue,)).fetchall():
        found[f"rescued_{reason}"] = int(count)
    return found, estimated


def _earliest_due(d: AdminDialect, queue: str) -> float | None:
    """The earliest run_at of the ready rows: each priority's, found as the claim finds
    them on tickler_ready (the priorities one probe each)."""
    m, ready = d.mark, d.ready_state
    sql = f"""
WITH RECURSIVE level(p) AS (
    SELECT max(priority) FROM tickler_requests WHERE queue = {m} AND {ready}
    UNION ALL
    SELECT (SELECT max(priority) FROM tickler_requests
            WHERE queue = {m} AND {ready} AND priority < level.p)
    FROM level WHERE level.p IS NOT NULL
)
SELECT min((SELECT min(run_at) FROM tickler_requests
            WHERE queue = {m} AND {ready} AND priority = level.p))
FROM level WHERE level.p IS NOT NULL"""
    row = d.execute(sql, (queue, queue, queue)).fetchone()
    return None if row is None or row[0] is None else float(row[0])


def _percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank percentile of sorted ``values``."""
    if not values:
        return None
    return values[max(0, math.ceil(q * len(values)) - 1)]


def _overview(d: AdminDialect, queue: str) -> QueueOverview:
    m = d.mark
    now = d.now()[0]
    counts, estimated = _counts(d, queue, COUNT_CAP)
    due = _earliest_due(d, queue)
    first_minute = math.floor(now / 60) - 59
    by_minute = {minute: (0, 0) for minute in range(first_minute, first_minute + 60)}
    # Counted as they finished, by the store's trigger (see tickler_minutes): counting
    # the rows of a busy hour would read up to a million of them.
    sql = (
        "SELECT minute, sum(succeeded), sum(failed) FROM tickler_minutes"
        f" WHERE queue = {m} AND minute >= {m} GROUP BY minute"
    )
    for minute, succeeded, failed in d.execute(sql, (queue, first_minute)):
        if int(minute) in by_minute:
            by_minute[int(minute)] = (int(succeeded), int(failed))
    times = (
        "SELECT started_at - run_at, finished_at - started_at FROM tickler_requests"
        f" WHERE queue = {m} AND finished_at >= {m} AND finished_at IS NOT NULL"
        f" AND {sql_in(ENDED)} AND started_at IS NOT NULL"
        f" ORDER BY finished_at DESC LIMIT {m}"
    )
    rows = d.execute(times, (queue, now - WINDOW, PERCENTILE_ROWS)).fetchall()
    waits = sorted(max(0.0, float(w)) for w, _ in rows)
    runs = sorted(max(0.0, float(r)) for _, r in rows)
    return QueueOverview(
        queue=queue,
        counts=counts,
        oldest_queued_age=None if due is None or due > now else now - due,
        running=counts["running"],
        paused=bool(counts["paused"]),
        per_minute=[(minute * 60.0, *by_minute[minute]) for minute in sorted(by_minute)],
        wait_p50=_percentile(waits, 0.5),
        wait_p95=_percentile(waits, 0.95),
        run_p50=_percentile(runs, 0.5),
        run_p95=_percentile(runs, 0.95),
        estimated=estimated,
    )


def _overviews(d: AdminDialect) -> list[QueueOverview]:
    return [_overview(d, queue) for queue in _queues(d)]


def _replicas(d: AdminDialect, lease: float) -> list[Replica]:
    """Each live replica (by host, then pid), with the leases it holds (on
    tickler_running: the running rows alone)."""
    sql = (
        "SELECT owner, queue, count(*), max(lease_until) FROM tickler_requests"
        " WHERE state = 'running' AND owner IS NOT NULL GROUP BY owner, queue"
    )
    held: dict[str, tuple[int, float, list[str]]] = {}
    for owner, queue, count, until in d.execute(sql, ()):
        leased, latest, queues = held.get(owner, (0, -math.inf, []))
        held[owner] = (leased + int(count), max(latest, float(until)), [*queues, str(queue)])
    found = []
    for owner, host, pid, since in d.live_owners():
        leased, until, queues = held.get(owner, (0, None, []))
        found.append(
            Replica(
                owner=owner,
                host=host,
                pid=pid,
                since=since,
                leased=leased,
                last_renewed=None if until is None else until - lease,
                lease_until=until,
                queues=sorted(queues),
            )
        )
    return sorted(found, key=lambda r: (r.host, r.pid, r.owner))


# -- The API


class Admin:
    """Acts on every queue of a store, with no service running: see ``store.admin()``.

    Every method is async and runs its SQL on a worker thread, one call at a time on the
    admin's own session (one connection), opened at the first call. Any Trio run may
    call it. A read-only admin (``store.admin(read_only=True)``) writes nothing: its
    session opens the store read-only, and each method that would write raises
    PermissionError.
    """

    def __init__(
        self,
        name: str,
        connect: Callable[[], AdminDialect],
        codecs: dict[str, Codec],
        lease: float,
        *,
        read_only: bool = False,
    ) -> None:
        self._name = name
        self._connect = connect
        self._codecs = codecs
        self._lease = lease
        self._session: AdminDialect | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.read_only = read_only

    def __repr__(self) -> str:
        return f"<{'read-only ' if self.read_only else ''}admin of {self._name}>"

    def _writes(self, action: str) -> None:
        if self.read_only:
            raise PermissionError(f"{self!r} writes nothing: {action} refused")

    async def _run(self, call: Callable[..., _T], *args: Any) -> _T:
        def work() -> _T:
            with self._lock:
                if self._closed:
                    raise RuntimeError(f"{self!r} is closed")
                if self._session is None:
                    self._session = self._connect()
                return self._session.run_admin(call, *args)

        return await trio.to_thread.run_sync(work)

    def _decode(self, queue: str, data: bytes | None) -> Any:
        if data is None:
            return None
        codec = self._codecs.get(queue) or JsonCodec()
        try:
            return codec.decode(bytes(data))
        except Exception:
            return bytes(data)

    def _request(self, row: tuple[Any, ...]) -> AdminRequest:
        (id_, queue, key, state, request, priority, group, attempts, enqueued_at, run_at) = row[:10]
        (started, finished, owner, lease_until, asked, etype, message, tb, result) = row[10:]
        return AdminRequest(
            id=int(id_),
            queue=queue,
            key=None if key is None else json.loads(key),
            state=state,
            request=self._decode(queue, request),
            priority=int(priority),
            group=group,
            attempts=int(attempts),
            enqueued_at=float(enqueued_at),
            run_at=float(run_at),
            started_at=None if started is None else float(started),
            finished_at=None if finished is None else float(finished),
            owner=owner,
            lease_until=None if lease_until is None else float(lease_until),
            cancel_requested=bool(asked),
            error_type=etype,
            error_message=message,
            error_traceback=tb,
            result=self._decode(queue, result),
        )

    async def queues(self) -> list[str]:
        """Every queue with rows, or paused (or limited) once, by name."""
        return await self._run(_queues)

    async def lookup(self, queue: str, id_or_key: object) -> AdminRequest | None:
        """The request of an int id, or of a key (its live request, else its latest).

        An id is an int in 1..2**63-1 (MAX_ID), else ValueError; the same in ``cancel``
        and ``retry``."""
        _check_queue(queue)
        _check_id_or_key(id_or_key)
        row = await self._run(_row, queue, id_or_key)
        return None if row is None else self._request(row)

    async def cancel(self, queue: str, id_or_key: object) -> bool:
        """Cancel a live request: at once unless it runs; a running one is asked of its
        owner, which withdraws the attempt within one poll_interval, and it ends
        CANCELLED. False if the request is final, or unknown."""
        _check_queue(queue)
        _check_id_or_key(id_or_key)
        self._writes("cancel")
        return await self._run(_cancel, queue, id_or_key)

    async def retry(self, queue: str, id: int) -> bool:
        """Queue a failed or cancelled request again, due now; its attempts count on, and
        its error stays until its next attempt ends. False for any other, or where its
        key is held by a later request."""
        _check_queue(queue)
        _check_id(id, "id")
        self._writes("retry")
        return bool(await self._run(_retry, queue, id))

    async def pause(self, queue: str) -> bool:
        """Every service of the queue stops claiming (what runs goes on).

        Returns whether the store knew the queue before: it had requests, or was paused,
        resumed or limited once (as ``queues()`` lists them). False is no error, since a
        queue may be paused ahead of its first deploy, but it may be a misspelt name:
        ``python -m tickler pause`` then warns, naming the known queues."""
        _check_queue(queue)
        self._writes("pause")
        return await self._run(_set_paused, queue, True)

    async def resume(self, queue: str) -> bool:
        """Let the queue's services claim again; whether the store knew it, as pause()."""
        _check_queue(queue)
        self._writes("resume")
        return await self._run(_set_paused, queue, False)

    async def counts(self, queue: str) -> dict[str, int]:
        """Rows by state, with the keys of a service's ``store_statistics()`` counts."""
        _check_queue(queue)
        return (await self._run(_counts, queue))[0]

    async def requests(
        self,
        queue: str,
        *,
        state: str | None = None,
        key: object = None,
        group: str | None = None,
        after: int | None = None,
        limit: int = 50,
    ) -> AdminPage:
        """A page of the queue's requests, newest (highest id) first, of those with ids
        below ``after``.

        Raises:
            ValueError: ``after`` is not in 1..2**63-1 (MAX_ID), or ``limit`` not in
                1..MAX_LIMIT; ``state``, ``key`` or ``group`` is not one.
        """
        _check_queue(queue)
        f = _Filter.of(state, key, group)
        if after is not None:
            _check_id(after, "after")
        _check_int(limit, "limit", 1, MAX_LIMIT)
        rows = await self._run(_page, queue, f, after, limit + 1)
        page = [self._request(row) for row in rows[:limit]]
        return AdminPage(page, page[-1].id if len(rows) > limit else None)

    async def count_where(
        self, queue: str, *, state: str | None = None, key: object = None, group: str | None = None
    ) -> int:
        """How many requests of the queue the filter selects."""
        _check_queue(queue)
        return await self._run(_count_where, queue, _Filter.of(state, key, group))

    async def cancel_where(
        self, queue: str, *, state: str | None = None, key: object = None, group: str | None = None
    ) -> int:
        """cancel() of every live request the filter selects, in one statement (but for
        the rows a replica's batch holds at that instant, each written on its own once
        that batch commits); how many were cancelled or asked to cancel."""
        _check_queue(queue)
        f = _Filter.of(state, key, group)
        self._writes("cancel_where")
        return await self._run(_cancel_where, queue, f)

    async def retry_where(
        self, queue: str, *, state: str | None = None, key: object = None, group: str | None = None
    ) -> int:
        """retry() of every failed or cancelled request the filter selects, in one
        statement (but for the rows a replica's batch holds at that instant, each written
        on its own once that batch commits); how many were queued again."""
        _check_queue(queue)
        f = _Filter.of(state, key, group)
        self._writes("retry_where")
        return await self._run(_retry_where, queue, f)

    async def overview(self) -> list[QueueOverview]:
        """Each queue at a glance (see QueueOverview)."""
        return await self._run(_overviews)

    async def replicas(self) -> list[Replica]:
        """Every live replica, by host, then pid: each service whose liveness mark the
        store holds now, with the leases it holds (none, for an idle one)."""
        return await self._run(_replicas, self._lease)

    async def aclose(self) -> None:
        """Close the admin's session; the admin takes no more calls."""

        def close() -> None:
            with self._lock:
                self._closed = True
                session, self._session = self._session, None
            if session is not None:
                session.close()

        await trio.to_thread.run_sync(close)

    async def __aenter__(self) -> Admin:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
