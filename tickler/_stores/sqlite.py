"""SqliteStore: the queue's source of truth in one SQLite file, for every process on the host.

Everything here is synchronous and runs on a worker thread the service owns,
one batch per wake-up of its loop, each batch one transaction: the script of
_sql.run_batch, over SQLite's dialect, SqliteSession.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import math
import os
import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs

from .._codec import Codec, check_queue_name
from .._exceptions import StoreError
from .._states import FINAL, LIVE, READY, sql_any, sql_in
from .._values import Insert, Outcome, OutcomeKind
from ._admin import Admin, this_process
from ._seam import Batch, BatchResult, Row
from ._sql import (
    COUNTED_STATE,
    INSERT_COLUMNS,
    KNOWN_QUEUES,
    LEASE_LAPSED,
    OUTCOME_VALUES,
    OWNER_DIED,
    RESCUE_RETURNED,
    RESCUE_SETS,
    ROW_COLUMNS,
    SETS,
    Claimed,
    Enqueue,
    EnqueueTracer,
    LimitedMemo,
    QueueReport,
    Statements,
    busiest_groups,
    cancel,
    counts,
    enqueue_rows,
    lookup,
    prepare_enqueue,
    report,
    run_batch,
    seconds,
    traced_enqueue,
)
from ._sqlite_live import Liveness

SCHEMA_VERSION = 8

_T = TypeVar("_T")

# Which states a partial index holds, written out as ORs: SQLite builds a
# temporary table for an IN list of three or more values each time it checks
# a row against an index's WHERE clause, which every UPDATE of state does.
# A query uses a partial index when it holds the index's WHERE term as is.
_READY = sql_any(READY)
_LIVE_STATE = sql_any(LIVE)
_FINAL_STATE = sql_in(FINAL)

# The indexes version 2 changed, by name: the schema creates them, and the
# migration from version 1 drops and creates them again.
_INDEXES_OF_V2 = {
    "tickler_live_keys": "CREATE UNIQUE INDEX tickler_live_keys ON tickler_requests (queue, key)"
    f" WHERE key IS NOT NULL AND {_LIVE_STATE}",
    "tickler_ready": "CREATE INDEX tickler_ready ON tickler_requests (queue, run_at, id)"
    f" WHERE {_READY}",
    # A row has finished_at exactly when it is final. Said of finished_at,
    # the index is left alone by a claim, which sets no finished_at.
    "tickler_finished": "CREATE INDEX tickler_finished ON tickler_requests (finished_at)"
    " WHERE finished_at IS NOT NULL",
}

# Version 3's claim index: ready rows in the order they are claimed, the higher priority
# first. It keeps the name of version 2's, which ordered by run_at alone.
_READY_INDEX_OF_V3 = (
    "CREATE INDEX tickler_ready ON tickler_requests (queue, priority DESC, run_at, id)"
    f" WHERE {_READY}"
)
_V3_INDEXES = ";\n".join(
    _READY_INDEX_OF_V3 if name == "tickler_ready" else create
    for name, create in _INDEXES_OF_V2.items()
)

# Version 3's tables besides tickler_requests: each queue's paused flag, and the last
# tick of each periodic request; each a b-tree on its primary key (WITHOUT ROWID).
_TABLES_OF_V3 = (
    "CREATE TABLE IF NOT EXISTS tickler_queues ("
    " queue TEXT PRIMARY KEY, paused BOOLEAN NOT NULL DEFAULT FALSE) WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS tickler_periodic ("
    " queue TEXT NOT NULL, name TEXT NOT NULL, last_tick REAL NOT NULL,"
    " PRIMARY KEY (queue, name)) WITHOUT ROWID",
)

_V3_TABLES = ";\n".join(_TABLES_OF_V3)

_SCHEMA = f"""
CREATE TABLE tickler_schema (version INTEGER NOT NULL);
CREATE TABLE tickler_requests (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    queue TEXT NOT NULL,
    key TEXT,
    state TEXT NOT NULL,
    request BLOB NOT NULL,
    result BLOB,
    error_type TEXT,
    error_message TEXT,
    error_traceback TEXT,
    attempts INTEGER NOT NULL DEFAULT 0,
    run_at REAL NOT NULL,
    enqueued_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    owner TEXT,
    lease_until REAL,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    priority INTEGER NOT NULL DEFAULT 0,
    unique_until REAL
);
CREATE INDEX tickler_keys ON tickler_requests (queue, key) WHERE key IS NOT NULL;
CREATE INDEX tickler_running ON tickler_requests (queue, lease_until)
    WHERE state = 'running';
{_V3_INDEXES};
{_V3_TABLES};
"""


def _to_v2(db: sqlite3.Connection) -> None:
    """Version 2: the partial indexes' states written as ORs."""
    for name, create in _INDEXES_OF_V2.items():
        db.execute(f"DROP INDEX IF EXISTS {name}")
        db.execute(create)


def _to_v3(db: sqlite3.Connection) -> None:
    """Version 3: each row's priority and the time until which it holds its key; the claim
    index in priority order; the queues' paused flags and the periodic requests' ticks.

    Each step is skipped where the file already has it.
    """
    columns = {row[1] for row in db.execute("PRAGMA table_info(tickler_requests)")}
    if "priority" not in columns:
        db.execute("ALTER TABLE tickler_requests ADD COLUMN priority INTEGER NOT NULL DEFAULT 0")
    if "unique_until" not in columns:
        db.execute("ALTER TABLE tickler_requests ADD COLUMN unique_until REAL")
    db.execute("DROP INDEX IF EXISTS tickler_ready")
    db.execute(_READY_INDEX_OF_V3)
    for create in _TABLES_OF_V3:
        db.execute(create)


# Version 4's index of ready rows by group, in claim order within each group: a group's
# first ready rows, the rows of no group, and the groups that have ready rows (one probe
# each) are read on it. A group's running rows are counted on tickler_running.
_GROUPS_INDEX = (
    "CREATE INDEX IF NOT EXISTS tickler_groups ON tickler_requests"
    f" (queue, group_name, priority DESC, run_at, id) WHERE {_READY}"
)

# Version 4's table of the recent starts of rate-limited groups, each a start of an attempt
# claimed under Batch.limits; deleted once older than the longest window of the limits.
_STARTS_TABLE = (
    "CREATE TABLE IF NOT EXISTS tickler_starts ("
    " queue TEXT NOT NULL, group_name TEXT NOT NULL, started_at REAL NOT NULL)"
)
_STARTS_INDEX = (
    "CREATE INDEX IF NOT EXISTS tickler_starts_by_group"
    " ON tickler_starts (queue, group_name, started_at)"
)


def _to_v4(db: sqlite3.Connection) -> None:
    """Version 4: each row's group, and the index of ready rows by group; the recent starts
    of rate-limited groups; each queue's limits as its last batch gave them (JSON).

    Each step is skipped where the file already has it.
    """
    columns = {row[1] for row in db.execute("PRAGMA table_info(tickler_requests)")}
    if "group_name" not in columns:
        db.execute("ALTER TABLE tickler_requests ADD COLUMN group_name TEXT")
    queue_columns = {row[1] for row in db.execute("PRAGMA table_info(tickler_queues)")}
    if "limits" not in queue_columns:
        db.execute("ALTER TABLE tickler_queues ADD COLUMN limits TEXT")
    db.execute(_GROUPS_INDEX)
    db.execute(_STARTS_TABLE)
    db.execute(_STARTS_INDEX)


# Version 5's indexes, which the admin API reads on (tickler._stores._admin): each
# queue's rows by state, newest first (pages, counts, the queues); a group's likewise,
# for the rows of a group only; and the rows finished, by queue and time, holding what
# the overview reads of them. A claim writes none of them but for the state.
_ADMIN_INDEXES = (
    "CREATE INDEX IF NOT EXISTS tickler_by_state ON tickler_requests (queue, state, id)",
    "CREATE INDEX IF NOT EXISTS tickler_by_group"
    " ON tickler_requests (queue, group_name, state, id) WHERE group_name IS NOT NULL",
    "CREATE INDEX IF NOT EXISTS tickler_finished_by_queue"
    " ON tickler_requests (queue, finished_at, state, run_at, started_at)"
    " WHERE finished_at IS NOT NULL",
)


# Version 5 also keeps the overview's finished requests per minute, which counting the
# rows of a busy hour would take too long for: a row trigger adds each row ended
# SUCCEEDED or FAILED to its (queue, minute, owner) row (SQLite has one writer at a time),
# and drops the queue's rows two hours older. The rows finished within the last two
# hours are counted in on creation (owner '').
_MINUTES = (
    "CREATE TABLE IF NOT EXISTS tickler_minutes ("
    " queue TEXT NOT NULL, minute INTEGER NOT NULL, owner TEXT NOT NULL,"
    " succeeded INTEGER NOT NULL, failed INTEGER NOT NULL,"
    " PRIMARY KEY (queue, minute, owner)) WITHOUT ROWID",
    "CREATE TRIGGER IF NOT EXISTS tickler_count_finished AFTER UPDATE OF state"
    " ON tickler_requests"
    " WHEN NEW.state IN ('succeeded', 'failed') AND OLD.state NOT IN ('succeeded', 'failed')"
    " AND NEW.finished_at IS NOT NULL"
    " BEGIN"
    " INSERT INTO tickler_minutes (queue, minute, owner, succeeded, failed)"
    " VALUES (NEW.queue, CAST(NEW.finished_at / 60 AS INTEGER), coalesce(OLD.owner, ''),"
    " NEW.state = 'succeeded', NEW.state = 'failed')"
    " ON CONFLICT (queue, minute, owner) DO UPDATE"
    " SET succeeded = succeeded + excluded.succeeded, failed = failed + excluded.failed;"
    " DELETE FROM tickler_minutes WHERE queue = NEW.queue"
    " AND minute < CAST(NEW.finished_at / 60 AS INTEGER) - 120;"
    " END",
)

# The finished rows of the last two hours, counted into tickler_minutes (where none are).
BACKFILL_MINUTES = (
    "INSERT INTO tickler_minutes (queue, minute, owner, succeeded, failed)"
    " SELECT queue, CAST(finished_at / 60 AS INTEGER), '',"
    " sum(state = 'succeeded'), sum(state = 'failed') FROM tickler_requests"
    " WHERE finished_at >= CAST(strftime('%s', 'now') AS REAL) - 7200"
    " AND finished_at IS NOT NULL AND state IN ('succeeded', 'failed')"
    " GROUP BY 1, 2 ON CONFLICT DO NOTHING"
)


def _to_v5(db: sqlite3.Connection) -> None:
    """Version 5: the admin API's indexes, and its count of the finished per minute. A
    step of its own, skipped where the file already has it."""
    for create in (*_ADMIN_INDEXES, *_MINUTES, BACKFILL_MINUTES):
        db.execute(create)


def _add_trace_context(db: sqlite3.Connection) -> None:
    """The step that adds each row's trace context: the W3C traceparent and tracestate of
    the span that enqueued it (tickler.otel), read by the process that claims it.

    A step of its own, skipped where the file already has it.
    """
    columns = {row[1] for row in db.execute("PRAGMA table_info(tickler_requests)")}
    if "traceparent" not in columns:
        db.execute("ALTER TABLE tickler_requests ADD COLUMN traceparent TEXT")
    if "tracestate" not in columns:
        db.execute("ALTER TABLE tickler_requests ADD COLUMN tracestate TEXT")


# Version 7's count of each queue's rescues by reason (see _sql.RESCUE_REASONS).
_RESCUES_TABLE = (
    "CREATE TABLE IF NOT EXISTS tickler_rescues ("
    " queue TEXT NOT NULL, reason TEXT NOT NULL, count INTEGER NOT NULL,"
    " PRIMARY KEY (queue, reason)) WITHOUT ROWID"
)


def _to_v7(db: sqlite3.Connection) -> None:
    """Version 7: why and when each row was last rescued (claimed again while running:
    its owner's liveness lock was free, or its lease lapsed), and each queue's rescues
    by reason.

    Each step is skipped where the file already has it.
    """
    columns = {row[1] for row in db.execute("PRAGMA table_info(tickler_requests)")}
    if "rescued" not in columns:
        db.execute("ALTER TABLE tickler_requests ADD COLUMN rescued TEXT")
    if "rescued_at" not in columns:
        db.execute("ALTER TABLE tickler_requests ADD COLUMN rescued_at REAL")
    db.execute(_RESCUES_TABLE)


# Version 8's record of each live service (its owner id) with the host and process that
# hold its liveness lock, and since when: what the admin lists as replicas. A service
# writes its row as it takes its lock, and deletes it as it closes; a row whose lock is
# free is deleted by the next service that writes its own, and never listed.
_OWNERS_TABLE = (
    "CREATE TABLE IF NOT EXISTS tickler_owners ("
    " owner TEXT PRIMARY KEY, host TEXT NOT NULL, pid INTEGER NOT NULL, since REAL NOT NULL)"
    " WITHOUT ROWID"
)


def _to_v8(db: sqlite3.Connection) -> None:
    """Version 8: the live services, with their host and process (see _OWNERS_TABLE). A
    step of its own, skipped where the file already has it."""
    db.execute(_OWNERS_TABLE)


# From each older version, what brings a file to the next one.
_MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {
    1: _to_v2,
    2: _to_v3,
    3: _to_v4,
    4: _to_v5,
    5: _add_trace_context,
    6: _to_v7,
    7: _to_v8,
}

# A keyed row, unless its key is held by a row whose unique_until has not come, or live
# (the conflict with tickler_live_keys).
_INSERT = f"""
{INSERT_COLUMNS}
SELECT ?, ?, ?, ?, ?, ?, ?, ?, ?
WHERE NOT EXISTS (
    SELECT 1 FROM tickler_requests
    WHERE queue = ? AND key = ? AND key IS NOT NULL AND unique_until > ?
)
ON CONFLICT (queue, key)
    WHERE key IS NOT NULL AND {_LIVE_STATE}
    DO NOTHING
RETURNING id
"""  # noqa: S608 (constants only)

# The row holding a key: the live one, else the latest held.
_HOLDER_OF_KEY = f"""
SELECT id FROM tickler_requests
WHERE queue = ? AND key = ? AND key IS NOT NULL AND ({_LIVE_STATE} OR unique_until > ?)
ORDER BY {_LIVE_STATE} DESC, id DESC LIMIT 1
"""  # noqa: S608 (constants only)

# enqueue_many_in's holders: (key, id) of the given keys' holders, each key's first.
_HOLDERS = f"""
SELECT key, id FROM tickler_requests
WHERE queue = ? AND key IN (SELECT value FROM json_each(?)) AND key IS NOT NULL
    AND ({_LIVE_STATE} OR unique_until > ?)
ORDER BY key, {_LIVE_STATE} DESC, id DESC
"""  # noqa: S608 (constants only)

# enqueue_many_in's rows, (key, request) each, as many as _MANY_ROWS in one statement:
# the same words for every full chunk, so one prepared statement. The first six
# parameters are (queue, state, run_at, enqueued_at (now), priority, unique_until), and the
# seventh the group.
_MANY_ROWS = 1000


# The trace context of the rows an enqueue_in wrote: that of its enqueue span.
_SET_TRACES = (
    "UPDATE tickler_requests SET traceparent = ?, tracestate = nullif(?, '')"
    " WHERE id IN (SELECT value FROM json_each(?))"
)


@functools.cache
def _many_sql(rows: int) -> str:
    """enqueue_many_in's INSERT of ``rows`` rows; only placeholders are formatted in."""
    values = ",".join(["(?, ?)"] * rows)
    return (
        f"{INSERT_COLUMNS} SELECT ?1, v.column1, ?2, v.column2, ?3, ?4, ?5,"  # noqa: S608
        " CASE WHEN v.column1 IS NULL THEN NULL ELSE ?6 END, ?7"
        f" FROM (VALUES {values}) AS v"
        " WHERE v.column1 IS NULL OR NOT EXISTS ("
        " SELECT 1 FROM tickler_requests AS h WHERE h.queue = ?1 AND h.key = v.column1"
        " AND h.key IS NOT NULL AND h.unique_until > ?4)"
        f" ON CONFLICT (queue, key) WHERE key IS NOT NULL AND {_LIVE_STATE} DO NOTHING"
        " RETURNING id, key"
    )


_COUNT_RESCUES = (
    "INSERT INTO tickler_rescues (queue, reason, count) VALUES (?, ?, ?)"
    " ON CONFLICT (queue, reason) DO UPDATE SET count = count + excluded.count"
)

_RECORD_OWNER = (
    "INSERT INTO tickler_owners (owner, host, pid, since) VALUES (?, ?, ?, ?)"
    " ON CONFLICT (owner) DO UPDATE"
    " SET host = excluded.host, pid = excluded.pid, since = excluded.since"
)
_OTHER_OWNERS = "SELECT owner FROM tickler_owners WHERE owner <> ?"
_FORGET_OWNERS = "DELETE FROM tickler_owners WHERE owner IN (SELECT value FROM json_each(?))"

_LIVE_WHERE = f"SELECT id, state FROM tickler_requests WHERE queue = ? AND {_LIVE_STATE} AND"  # noqa: S608 (constants only)
_ROW = f"SELECT {ROW_COLUMNS} FROM tickler_requests"  # noqa: S608 (constants only)

_STATEMENTS = Statements(
    insert=_INSERT,
    holder_of_key=_HOLDER_OF_KEY,
    renew="UPDATE tickler_requests SET lease_until = ?"
    " WHERE queue = ? AND state = 'running' AND owner = ? AND lease_until > 0",
    mine="SELECT id, cancel_requested FROM tickler_requests"
    " WHERE queue = ? AND state = 'running' AND owner = ? AND lease_until > 0",
    count_rescues=_COUNT_RESCUES,
    end_cancelled_orphans="UPDATE tickler_requests"
    " SET state = 'cancelled', finished_at = ?, owner = NULL, lease_until = NULL"
    " WHERE queue = ? AND state = 'running' AND lease_until < ? AND owner <> ?"
    " AND cancel_requested",
    recent=f"SELECT id FROM tickler_requests WHERE queue = ? AND {_FINAL_STATE}"  # noqa: S608 (constants only)
    " AND finished_at >= ?",
    # (The scan is on tickler_finished, by finished_at; the queue is a filter on top of it.)
    prune="DELETE FROM tickler_requests WHERE id IN ("  # noqa: S608 (constants only)
    f" SELECT id FROM tickler_requests WHERE queue = ? AND {_FINAL_STATE} AND finished_at < ?"
    " AND (unique_until IS NULL OR unique_until <= ?) LIMIT ?)",
    has="SELECT 1 FROM tickler_requests WHERE id = ?",
    row_by_id=f"{_ROW} WHERE queue = ? AND id = ?",
    set_trace="UPDATE tickler_requests SET traceparent = ?, tracestate = ? WHERE id = ?",
    traces_of="SELECT id, traceparent, tracestate, key, priority, group_name"
    " FROM tickler_requests WHERE id IN (SELECT value FROM json_each(?))",
    row_by_key=f"{_ROW} WHERE queue = ? AND key = ?"
    " ORDER BY state NOT IN ('queued', 'scheduled', 'running', 'retrying'), id DESC LIMIT 1",
    live_by_id=f"{_LIVE_WHERE} id = ?",
    live_by_key=f"{_LIVE_WHERE} key = ?",
    ask_cancel="UPDATE tickler_requests SET cancel_requested = TRUE WHERE id = ?",
    cancel_now="UPDATE tickler_requests SET state = 'cancelled', finished_at = ? WHERE id = ?",
    counts=f"SELECT {COUNTED_STATE} AS s, count(*) FROM tickler_requests"  # noqa: S608 (constants only)
    " WHERE queue = ? GROUP BY s"
    " UNION ALL SELECT 'paused', CASE WHEN paused THEN 1 ELSE 0 END FROM tickler_queues"
    " WHERE queue = ?"
    " UNION ALL SELECT 'rescued_' || reason, count FROM tickler_rescues WHERE queue = ?",
    set_paused="INSERT INTO tickler_queues (queue, paused) VALUES (?, ?)"
    " ON CONFLICT (queue) DO UPDATE SET paused = excluded.paused",
    tick_insert="INSERT INTO tickler_periodic (queue, name, last_tick) VALUES (?, ?, ?)"
    " ON CONFLICT (queue, name) DO NOTHING RETURNING 1",
    tick_advance="UPDATE tickler_periodic SET last_tick = ?"
    " WHERE queue = ? AND name = ? AND last_tick < ? RETURNING 1",
    set_limits="INSERT INTO tickler_queues (queue, limits) VALUES (?, ?)"
    " ON CONFLICT (queue) DO UPDATE SET limits = excluded.limits",
    limits_of="SELECT limits FROM tickler_queues WHERE queue = ?",
    paused="SELECT paused FROM tickler_queues WHERE queue = ?",
    # (on tickler_running: the running rows of the queue whose lease runs after now)
    running_groups="SELECT group_name, count(*) FROM tickler_requests"
    " WHERE queue = ? AND state = 'running' AND lease_until > ? AND group_name IS NOT NULL"
    " GROUP BY group_name",
    starts_since="SELECT group_name, started_at FROM tickler_starts"
    " WHERE queue = ? AND started_at > ?",
    prune_starts="DELETE FROM tickler_starts WHERE queue = ? AND started_at <= ?",
    ready_groups=f"""
WITH RECURSIVE g(name) AS (
    SELECT min(group_name) FROM tickler_requests
    WHERE queue = ? AND {_READY} AND group_name IS NOT NULL
    UNION ALL
    SELECT (SELECT min(group_name) FROM tickler_requests
            WHERE queue = ? AND {_READY} AND group_name > g.name)
    FROM g WHERE g.name IS NOT NULL
)
SELECT name FROM g WHERE name IS NOT NULL""",  # noqa: S608 (constants only)
    ungrouped_ready="SELECT id, priority, run_at, group_name FROM tickler_requests"  # noqa: S608 (constants only)
    f" INDEXED BY tickler_groups WHERE queue = ? AND {_READY} AND group_name IS NULL"
    " AND run_at <= ? ORDER BY priority DESC, run_at, id LIMIT ?",
    expired_rows="SELECT id, priority, run_at, group_name FROM tickler_requests"
    " WHERE queue = ? AND state = 'running' AND lease_until < ?"
    " AND owner <> ? AND NOT cancel_requested ORDER BY lease_until LIMIT ?",
    limited_count="SELECT count(*) FROM tickler_requests INDEXED BY tickler_groups"  # noqa: S608 (constants only)
    f" WHERE queue = :queue AND {_READY}"
    " AND group_name IN (SELECT value FROM json_each(:groups)) AND run_at <= :now",
    limited_upto="SELECT count(*) FROM (SELECT 1 FROM tickler_requests INDEXED BY tickler_groups"  # noqa: S608 (constants only)
    f" WHERE queue = :queue AND {_READY}"
    " AND group_name IN (SELECT value FROM json_each(:groups)) AND run_at <= :now"
    " LIMIT :cap)",
    busiest_groups=busiest_groups("?", _LIVE_STATE),
)

# A limited claim's rows by id (owner, lease_until, ids, now, owner), RETURNING them as
# Claimed, the rescue's reason last (its rescue recorded, see RESCUE_SETS); then a start of
# each group of a list (a group listed twice started twice).
_CLAIM_IDS = (
    "UPDATE tickler_requests SET state = 'running', owner = ?1, lease_until = ?2,"  # noqa: S608 (constants only)
    f" attempts = attempts + 1, started_at = NULL, {RESCUE_SETS.format(now='?4')}"
    f" WHERE id IN (SELECT value FROM json_each(?3)) AND ({_READY}"
    " OR (state = 'running' AND lease_until < ?4 AND owner <> ?5 AND NOT cancel_requested))"
    " RETURNING id, request, attempts, key, enqueued_at, run_at, priority,"
    f" {RESCUE_RETURNED.format(now='?4')}"
)
_RECORD_STARTS = (
    "INSERT INTO tickler_starts (queue, group_name, started_at)"
    " SELECT ?1, value, ?2 FROM json_each(?3)"
)

# A limited claim's rows: of one priority, due by now, in claim order, with their group.
_READY_AT_GROUPS = f"""
SELECT id, priority, run_at, group_name FROM tickler_requests
WHERE queue = :queue AND {_READY} AND priority = :priority AND run_at <= :now
ORDER BY run_at, id LIMIT :limit
"""  # noqa: S608 (constants only)

# A group's first ready rows due by now, in claim order, on tickler_groups.
_GROUP_HEAD = f"""
SELECT id, priority, run_at, group_name FROM tickler_requests INDEXED BY tickler_groups
WHERE queue = ? AND {_READY} AND group_name = ? AND run_at <= ?
ORDER BY priority DESC, run_at, id LIMIT ?
"""  # noqa: S608 (constants only)

# A claim runs under the file's write lock, in steps. Ready rows are taken
# priority by priority, the highest first: each priority's rows due by now, in
# the order they fell due, on tickler_ready, which holds (priority, run_at, id)
# under each queue, so that rows scheduled for later are never read; and
# priorities are found one at a time on the same index, each the largest below
# the last. Rows whose lease expired (their process died) are taken with them,
# in the same order: a rescue goes before the backlog queued after it.
_PAUSED = "SELECT paused FROM tickler_queues WHERE queue = ?"

_TOP_PRIORITY = f"SELECT max(priority) FROM tickler_requests WHERE queue = ? AND {_READY}"  # noqa: S608 (constants only)

_NEXT_PRIORITY = f"{_TOP_PRIORITY} AND priority < ?"

_READY_AT = f"""
SELECT id, priority, run_at FROM tickler_requests
WHERE queue = :queue AND {_READY} AND priority = :priority AND run_at <= :now
ORDER BY run_at, id LIMIT :limit
"""  # noqa: S608 (constants only)

_EXPIRED = """
SELECT id, priority, run_at, lease_until FROM tickler_requests
WHERE queue = :queue AND state = 'running' AND lease_until < :now
    AND owner <> :owner AND NOT cancel_requested
ORDER BY lease_until LIMIT :limit
"""

_CLAIM = f"""
UPDATE tickler_requests
SET state = 'running', owner = ?1, lease_until = ?2, attempts = attempts + 1, started_at = NULL,
    {RESCUE_SETS.format(now="?4")}
WHERE id IN (SELECT value FROM json_each(?3))
RETURNING id, request, attempts, key, enqueued_at, run_at, priority,
    {RESCUE_RETURNED.format(now="?4")}
"""  # noqa: S608 (constants only)

# The owners of the queue's running rows whose leases no look found dead yet, but one's
# own (on tickler_running).
_RUNNING_OWNERS = (
    "SELECT DISTINCT owner FROM tickler_requests WHERE queue = ? AND state = 'running'"
    " AND lease_until > 0 AND owner <> ?"
)

# The leases of some of a dead owner's running rows of the queue lapse at once.
_MARK_DEAD = (
    "UPDATE tickler_requests SET lease_until = -?1 WHERE id IN (SELECT id FROM tickler_requests"
    " WHERE queue = ?2 AND state = 'running' AND owner = ?3 AND lease_until > 0"
    " ORDER BY lease_until LIMIT ?4)"
)

# When the next ready row falls due: the earliest run_at of each priority, the
# priorities found one at a time on tickler_ready (as the claim finds them).
_DUE_AND_LIVE = f"""
SELECT
    (WITH RECURSIVE level(p) AS (
        SELECT max(priority) FROM tickler_requests WHERE queue = :queue AND {_READY}
        UNION ALL
        SELECT (SELECT max(priority) FROM tickler_requests
                WHERE queue = :queue AND {_READY} AND priority < level.p)
        FROM level WHERE level.p IS NOT NULL
    )
    SELECT min((SELECT min(run_at) FROM tickler_requests
                WHERE queue = :queue AND {_READY} AND priority = level.p))
    FROM level WHERE level.p IS NOT NULL),
    EXISTS (SELECT 1 FROM tickler_requests WHERE queue = :queue AND {_READY})
    OR EXISTS (SELECT 1 FROM tickler_requests WHERE queue = :queue AND state = 'running'),
    coalesce((SELECT paused FROM tickler_queues WHERE queue = :queue), 0)
"""  # noqa: S608 (constants only)

# "succeeded" for requests whose result is None (kept as NULL), given as a
# JSON list of [id, attempt] pairs: written only at that attempt (null: any).
_SUCCEEDED_BARE = """
UPDATE tickler_requests
SET state = CASE WHEN cancel_requested THEN 'cancelled' ELSE 'succeeded' END,
    result = NULL, finished_at = ?1, owner = NULL, lease_until = NULL,
    started_at = coalesce(started_at, ?1)
FROM (SELECT value ->> 0 AS id, value ->> 1 AS attempt FROM json_each(?2)) AS v
WHERE tickler_requests.id = v.id AND owner = ?3 AND state = 'running'
    AND (v.attempt IS NULL OR attempts = v.attempt)
RETURNING tickler_requests.id, state
"""

# Attempts that started since the last batch and still run: a claimed row's
# started_at is NULL until its attempt starts (claimed ahead, not started),
# then the time of the first batch after the start. An attempt that ended
# before that batch gets it from its outcome's write.
_STARTED = """
UPDATE tickler_requests SET started_at = ?
WHERE id IN (SELECT value FROM json_each(?)) AND owner = ? AND state = 'running'
    AND started_at IS NULL
"""


class SqliteStore:
    """A durable queue in one SQLite file; one file can hold many queues.

    Each request is a row of the table ``tickler_requests``. Its ``key``
    column holds the request's key as canonical JSON, ASCII only:
    ``json.dumps(key, separators=(",", ":"))``, so the str key ``k`` is the
    text ``"k"`` (quotes included) and the tuple ``("order", 7)`` is
    ``["order",7]``; NULL for a request without a key. A row inserted by
    another driver de-duplicates against ``enqueue_in`` and the services
    only if its key is encoded so. An encoded key is at most MAX_KEY_BYTES
    (1,000) bytes and a queue name at most MAX_QUEUE_BYTES (1,000) bytes in
    UTF-8; longer ones are refused with ValueError.

    The tables are created when a service first opens the file, or by
    ``create_schema()``.

    Args:
        path: the database file, created if missing.
        synchronous: ``"FULL"`` (a commit survives power loss) or
            ``"NORMAL"`` (it survives a crash of the process, not of the
            machine).
        lease: seconds a claimed request stays leased; renewed every
            ``lease / 3`` while it runs.
        poll_interval: seconds between looks at the file for work enqueued
            by other processes, cancels and outcomes waited for.
        retention: seconds a final request is kept before it is deleted.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        synchronous: str = "FULL",
        lease: float = 30.0,
        poll_interval: float = 1.0,
        retention: float = 86400.0,
    ) -> None:
        if not isinstance(path, str | os.PathLike):
            raise TypeError("path must be a str or a path")
        if synchronous not in ("FULL", "NORMAL"):
            raise ValueError('synchronous must be "FULL" or "NORMAL"')
        self.path = Path(path)
        self.synchronous = synchronous
        self.lease = seconds("lease", lease)
        self.poll_interval = seconds("poll_interval", poll_interval)
        self.retention = seconds("retention", retention, allow_zero=True)
        # The codec of each queue's service in this process, for enqueue_in.
        self._codecs: dict[str, Codec] = {}
        # tickler.otel's, while enqueue_in and enqueue_many_in are traced.
        self._tracer: EnqueueTracer | None = None

    def __repr__(self) -> str:
        return f"tickler.SqliteStore({str(self.path)!r}, synchronous={self.synchronous!r})"

    def use_codec(self, queue: str, codec: Codec) -> None:
        """Encode what ``enqueue_in`` writes to ``queue`` with ``codec`` (its service's)."""
        self._codecs[queue] = codec

    def listener(self, queue: str) -> None:
        """Nothing tells a SQLite file's readers about new rows: they poll."""
        return

    def connect(self) -> SqliteSession:
        """Open the file, creating or checking its schema. Blocking: call it on a thread."""
        return SqliteSession(self)

    def admin(self, *, read_only: bool = False) -> Admin:
        """The admin API on every queue of the file, with no service running.

        Its methods are async; it opens its own connection at its first call (creating
        or upgrading the schema, as a service does) and closes it at ``aclose()``.

        Args:
            read_only: open the file read-only (SQLite's ``mode=ro``): the admin creates,
                migrates and writes nothing, and leaves the journal mode as it is; each
                method that would write raises PermissionError. Its first call raises
                StoreError if the file is missing, holds no tickler tables yet, or a
                schema of another version (it is not brought up to date).
        """
        if not isinstance(read_only, bool):
            raise TypeError("read_only must be a bool")
        return Admin(
            repr(self),
            functools.partial(SqliteSession, self, read_only=read_only),
            self._codecs,
            self.lease,
            read_only=read_only,
        )

    def create_schema(self) -> None:
        """Create tickler's tables in the file, or bring an older schema up to date.

        A service creates them when it starts; call this first to enqueue
        with ``enqueue_in`` before any service has run on the file. Calling
        it again does nothing. Blocking: in a Trio program, call it through
        ``trio.to_thread.run_sync(store.create_schema)``.

        Raises:
            StoreError: the file cannot be opened, is not a SQLite database,
                or holds a foreign schema under tickler's names.
        """
        SqliteSession(self).close()

    def enqueue_in(
        self,
        connection: sqlite3.Connection,
        queue: str,
        request: object,
        *,
        key: object = None,
        delay: float | None = None,
        priority: int = 0,
        unique_for: float | None = None,
        group: str | None = None,
    ) -> int:
        """Write a request through the caller's connection, inside its open transaction.

        The request exists if and only if the caller commits. A service
        running ``queue`` sees it within ``poll_interval``. The request is
        encoded with the codec of the service that runs ``queue`` in this
        process, else as JSON.

        Args:
            priority: higher runs first: among ready requests, the highest
                priority is claimed first, then the earliest due. An int in
                PostgreSQL's integer range (the stores share their limits).
            unique_for: seconds the key stays taken after this enqueue, even
                once the request is final (``math.inf``: for ever); retention
                keeps the row until then. Needs ``key``.
            group: the request's group, whose limits (a service's ``limits``) apply to
                it across every process; None: no group, never limited. A str of 1 to
                200 bytes in UTF-8, without NUL.

        Returns:
            The new request's id, or the id of the request holding ``key``: its
            live request, else the latest whose ``unique_for`` has not run out.

        Raises:
            StoreError: the file has no tickler schema yet: call
                ``create_schema()`` first, or start a service on the store.
            ValueError: ``queue`` is over MAX_QUEUE_BYTES, or the encoded
                ``key`` over MAX_KEY_BYTES (see the class's note on keys);
                ``priority`` or ``unique_for`` out of range, or ``unique_for``
                without ``key``.
            TypeError: ``priority`` is not an int, ``unique_for`` not a number,
                ``group`` not a str.
        """
        if not isinstance(connection, sqlite3.Connection):
            raise TypeError("connection must be a sqlite3.Connection")
        keyed = None if key is None else (lambda _: key)
        prepared = prepare_enqueue(
            self._codecs, queue, [request], keyed, delay, priority, unique_for, group
        )
        return self._traced(connection, queue, prepared)[0]

    def enqueue_many_in(
        self,
        connection: sqlite3.Connection,
        queue: str,
        requests: Iterable[object],
        *,
        key: Callable[[Any], object] | None = None,
        delay: float | None = None,
        priority: int = 0,
        unique_for: float | None = None,
        group: str | None = None,
    ) -> list[int]:
        """Write many requests through the caller's connection, inside its open transaction.

        As ``enqueue_in`` for each request, in order, in one statement per
        1,000 requests. ``key``, if given, is called with each request and
        gives its key, or None for none; ``group`` is every request's. Every
        request is checked and encoded before anything is written.

        Returns:
            Each request's id, in order: a request whose key is taken (by a
            live request, one held by ``unique_for``, or one earlier in
            ``requests``) gets the holder's.

        Raises:
            As ``enqueue_in``; TypeError if ``key`` is not callable.
        """
        if not isinstance(connection, sqlite3.Connection):
            raise TypeError("connection must be a sqlite3.Connection")
        prepared = prepare_enqueue(
            self._codecs, queue, requests, key, delay, priority, unique_for, group
        )
        return self._traced(connection, queue, prepared)

    def _traced(self, connection: sqlite3.Connection, queue: str, e: Enqueue) -> list[int]:
        """_enqueue, inside an enqueue span while tickler.otel traces this store."""
        return traced_enqueue(
            self._tracer,
            queue,
            len(e.requests),
            lambda trace: self._enqueue(connection, queue, e, trace),
        )

    def _enqueue(
        self,
        connection: sqlite3.Connection,
        queue: str,
        e: Enqueue,
        trace: tuple[str, str] | None = None,
    ) -> list[int]:
        """Insert prepared requests, with ``trace`` (the enqueue span's W3C traceparent and
        tracestate) in each new row; their ids. Times are this process's clock."""
        hold = None if e.unique_for is None else e.now + e.unique_for
        head = (queue, e.state, e.now + e.delay, e.now, e.priority, hold, e.group)
        new: list[int] = []

        def insert(rows: list[tuple[str | None, bytes]]) -> list[tuple[int, str | None]]:
            written: list[tuple[int, str | None]] = []
            for start in range(0, len(rows), _MANY_ROWS):
                chunk = rows[start : start + _MANY_ROWS]
                params = [*head, *(p for row in chunk for p in row)]
                written.extend(connection.execute(_many_sql(len(chunk)), params).fetchall())
            if trace is not None:
                new.extend(request_id for request_id, _ in written)
            return written

        def holders(keys: list[str]) -> dict[str, int]:
            found: dict[str, int] = {}
            for key, request_id in connection.execute(
                _HOLDERS, (queue, json.dumps(keys), e.now)
            ).fetchall():
                found.setdefault(key, request_id)
            return found

        if not e.requests:
            return []
        try:
            ids = enqueue_rows(insert, holders, e.keys, e.requests, f"queue {queue!r}")
        except sqlite3.OperationalError as exc:
            if "no such table: tickler_requests" not in str(exc):
                raise
            raise StoreError(
                f"{self.path} has no tickler schema yet: create it with store.create_schema()"
                " (blocking: in a Trio program, through trio.to_thread.run_sync), or start a"
                " service on the store first"
            ) from None
        if trace is not None and new:
            connection.execute(_SET_TRACES, (*trace, json.dumps(new)))
        return ids


class SqliteSession:
    """One service's connection to the file, and SQLite's dialect of _sql.run_batch.

    Used by one thread at a time.
    """

    statements = _STATEMENTS
    # Not in SQLite, which cannot commit while a statement has rows to give.
    reads_after_commit = False
    # How far each look at what became final reaches back before the last:
    # SQLite's writers commit one at a time, in the order of their times.
    finals_overlap = 1.0

    def __init__(self, store: SqliteStore, *, read_only: bool = False) -> None:
        self.limits_written: dict[str, str] = {}
        self.limited_memo: dict[str, LimitedMemo] = {}
        path = store.path
        self.liveness = Liveness(path)
        # The owner whose row of tickler_owners this session wrote (see _OWNERS_TABLE).
        self._recorded: str | None = None
        if path.is_dir():
            raise StoreError(f"{path} is a directory, not a SQLite database")
        if read_only:
            self.db = _open_read_only(path)
            return
        try:
            db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=60)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open {path}: {exc}") from None
        try:
            _check_schema(db, path)
            db.execute("PRAGMA journal_mode = WAL")
            db.execute(f"PRAGMA synchronous = {store.synchronous}")
        except BaseException:
            db.close()
            raise
        self.db = db

    # -- the Session

    def run(
        self, queue: str, owner: str, lease: float, retention: float, batch: Batch
    ) -> BatchResult:
        """Write and ask everything in ``batch`` in one transaction (see _sql.run_batch),
        holding ``owner``'s liveness lock.

        If a look finds the lock lost, the batch renews and claims nothing, and says so
        (BatchResult.lost): the caller takes a new owner id.
        """
        lost = self.liveness.hold(owner, batch.renew)
        if lost:
            batch = attrs.evolve(batch, claim=0, renew=False)
        elif owner != self._recorded:
            self._record(owner)
        self._look = batch.renew
        result = run_batch(self, queue, owner, lease, retention, batch)
        result.lost = lost
        return result

    def lookup(self, queue: str, id_or_key: object) -> Row | None:
        return lookup(self, queue, id_or_key)

    def cancel(self, queue: str, id_or_key: object) -> tuple[bool, int | None]:
        return cancel(self, queue, id_or_key)

    def statistics(self, queue: str) -> dict[str, int]:
        return counts(self, queue)

    def close(self) -> None:
        if self._recorded is not None:
            # (Best effort: a row left behind is never listed once the lock goes.)
            with contextlib.suppress(sqlite3.Error):
                self.db.execute("PRAGMA busy_timeout = 2000")
                self.db.execute(_FORGET_OWNERS, (json.dumps([self._recorded]),))
        self.liveness.release()
        self.db.close()

    def _record(self, owner: str) -> None:
        """Write ``owner``'s row of tickler_owners, this process's host and pid in it, now
        that its lock is held; delete the rows of the owner it replaces and of the owners
        whose lock is free. Once per owner id: a transaction of its own."""
        x = self.db.execute
        others = [row[0] for row in x(_OTHER_OWNERS, (owner,))]
        gone = self.liveness.dead(others)
        if self._recorded is not None:
            gone.append(self._recorded)
        host, pid = this_process()
        self.begin()
        try:
            x(_RECORD_OWNER, (owner, host, pid, time.time()))
            if gone:
                x(_FORGET_OWNERS, (json.dumps(gone),))
            self.commit()
        except BaseException:
            self.rollback()
            raise
        self._recorded = owner

    # -- the admin's words (see _admin.AdminDialect)

    mark = "?"
    ready_state = _READY
    # SQLite locks the whole file for a writer, never a row: no deadlock among its writers.
    skip_locked = ""

    def key_taken(self, exc: BaseException) -> bool:
        return isinstance(exc, sqlite3.IntegrityError) and "tickler_requests.queue" in str(exc)

    def deadlocked(self, exc: BaseException) -> bool:
        return False

    def estimate(self, sql: str, params: Sequence[Any]) -> int | None:
        """SQLite keeps no estimate of a query's rows."""
        return None

    def run_admin(self, call: Callable[..., _T], *args: Any) -> _T:
        try:
            return call(self, *args)
        except BaseException:
            self.rollback()
            raise

    def live_owners(self) -> list[tuple[str, str, int, float]]:
        """The recorded owners whose lock is held, asked of the kernel without taking it."""
        rows = self.db.execute("SELECT owner, host, pid, since FROM tickler_owners").fetchall()
        held = set(self.liveness.held([row[0] for row in rows]))
        return [(str(o), str(h), int(p), float(t)) for o, h, p, t in rows if o in held]

    # -- the Dialect

    def execute(self, sql: str, params: Any = ()) -> Any:
        return self.db.execute(sql, params)

    def begin(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def commit(self) -> None:
        self.db.execute("COMMIT")

    def rollback(self) -> None:
        if self.db.in_transaction:
            self.db.execute("ROLLBACK")

    def now(self) -> tuple[float, float]:
        """This process's clock: the file has none of its own."""
        return time.time(), 0.0

    def insert_rows(self, queue: str, entries: Sequence[Insert], now: float) -> Iterable[int]:
        """One INSERT of many rows; their ids counted back from the last.

        SQLite gives the rows of one statement consecutive ids: each is one
        more than the largest the table ever held (AUTOINCREMENT), and the
        write lock keeps every other writer out. Reading them from the last
        id costs less than RETURNING.
        """
        # Only placeholders are formatted into the statement.
        marks = ",".join(["(?, NULL, ?, ?, ?, ?, ?, NULL, ?)"] * len(entries))
        params = [
            p
            for e in entries
            for p in (queue, e.state, e.request, e.run_at, now, e.priority, e.group)
        ]
        cursor = self.db.execute(f"{INSERT_COLUMNS} VALUES {marks}", params)
        count, last = cursor.rowcount, cursor.lastrowid or 0
        if count != len(entries):
            raise StoreError(f"an insert wrote {count} rows of {len(entries)}")
        return range(last - count + 1, last + 1)

    def write_outcomes(
        self, owner: str, outcomes: Sequence[Outcome], now: float
    ) -> Callable[[], list[str | None]]:
        """One UPDATE per kind of outcome (and per chunk), joined with its rows as VALUES."""
        x = self.db.execute
        by_kind: dict[OutcomeKind, list[tuple[Any, ...]]] = {}
        # Successes without a result (None is kept as NULL) share every value
        # but the id: one statement over a list of ids, which costs SQLite
        # less per row than a join with VALUES.
        bare: list[tuple[int, int | None]] = []
        succeeded = OutcomeKind.SUCCEEDED
        for outcome in outcomes:
            kind = outcome.kind
            if kind is succeeded and outcome.result is None:
                bare.append((outcome.id, outcome.attempt))
            else:
                by_kind.setdefault(kind, []).append((*OUTCOME_VALUES[kind](outcome), now))
        applied: dict[int, str] = {}
        if bare:
            applied.update(x(_SUCCEEDED_BARE, (now, json.dumps(bare), owner)).fetchall())
        for kind, entries in by_kind.items():
            width = len(entries[0])  # (id, values, attempt, now)
            attempt = f"v.column{width - 1}"
            sets = SETS[kind].format(now=f"v.column{width}")
            per_statement = max(1, 900 // width)
            for start in range(0, len(entries), per_statement):
                chunk = entries[start : start + per_statement]
                row = "(" + ",".join("?" * width) + ")"
                params = [p for entry in chunk for p in entry]
                applied.update(
                    x(
                        f"UPDATE tickler_requests SET {sets}, owner = NULL,"  # noqa: S608
                        f" lease_until = NULL FROM (VALUES {','.join([row] * len(chunk))}) AS v"
                        " WHERE tickler_requests.id = v.column1 AND owner = ?"
                        f" AND state = 'running' AND ({attempt} IS NULL OR attempts = {attempt})"
                        " RETURNING tickler_requests.id, state",
                        [*params, owner],
                    ).fetchall()
                )
        written = [applied.get(outcome.id) for outcome in outcomes]
        return lambda: written

    def mark_started(self, owner: str, ids: Sequence[int], now: float) -> None:
        self.db.execute(_STARTED, (now, json.dumps(list(ids)), owner))

    def claim(
        self, queue: str, owner: str, now: float, lease_until: float, limit: int
    ) -> Callable[[], list[Claimed]]:
        """Claim in steps under the write lock (see _CLAIM): none while the queue is paused;
        ready rows priority by priority, until ``limit`` are found; expired leases."""
        x = self.db.execute
        if (paused := x(_PAUSED, (queue,)).fetchone()) is not None and paused[0]:
            return list
        found: list[tuple[int, int, float]] = []
        priority = x(_TOP_PRIORITY, (queue,)).fetchone()[0]
        while priority is not None and len(found) < limit:
            params = {"queue": queue, "priority": priority, "now": now}
            found.extend(x(_READY_AT, {**params, "limit": limit - len(found)}).fetchall())
            priority = x(_NEXT_PRIORITY, (queue, priority)).fetchone()[0]
        params = {"queue": queue, "now": now, "owner": owner, "limit": limit}
        expired_rows = x(_EXPIRED, params).fetchall()
        found.extend(row[:3] for row in expired_rows)
        expired = {row[0]: row[3] for row in expired_rows}  # id: lease_until
        if not found:
            return list
        found.sort(key=lambda row: (-row[1], row[2], row[0]))
        picked = [row[0] for row in found[:limit]]
        rows: list[Claimed] = x(_CLAIM, (owner, lease_until, json.dumps(picked), now)).fetchall()
        rescued = collections.Counter(
            OWNER_DIED if expired[i] < 0 else LEASE_LAPSED for i in picked if i in expired
        )
        for reason, count in rescued.items():
            x(_COUNT_RESCUES, (queue, reason, count))
        return rows.copy

    def due_and_live(self, queue: str) -> Callable[[], tuple[float | None, int, bool]]:
        return self.db.execute(_DUE_AND_LIVE, {"queue": queue}).fetchone

    def finals(self, ids: Sequence[int]) -> list[Row]:
        found: list[Row] = []
        for start in range(0, len(ids), 500):
            chunk = list(ids[start : start + 500])
            marks = ",".join("?" * len(chunk))
            sql = f"{_ROW} WHERE id IN ({marks}) AND {_FINAL_STATE}"
            found.extend(Row(*row) for row in self.db.execute(sql, chunk))
        return found

    def notify(self, queue: str) -> None:
        """Nothing tells a file's readers about new rows: they poll."""

    def after_error_in_transaction(self) -> None:
        """Nothing to do: SQLite takes the next statement after one failed."""

    # Whether the batch under way is a look (Batch.renew).
    _look = False

    def mark_dead(self, queue: str, owner: str, now: float, limit: int) -> None:
        """The owners whose byte of the lock file is free: the leases of up to ``limit`` of
        their rows lapse now. Only in a look's claim (every poll_interval, or lease / 3):
        finding the owners reads every running row of the queue, which a claim between
        two looks (a busy process's many small ones) does not pay for."""
        if not self._look:
            return
        x = self.db.execute
        owners = [row[0] for row in x(_RUNNING_OWNERS, (queue, owner))]
        for dead in self.liveness.dead(owners):
            limit -= x(_MARK_DEAD, (now, queue, dead, limit)).rowcount
            if limit <= 0:
                break

    def listed(self, values: Sequence[Any]) -> str:
        return json.dumps(list(values))

    def lock_limited(self, queue: str) -> None:
        """Nothing to do: the batch holds the file's write lock (BEGIN IMMEDIATE)."""

    def ready_chunk(self, queue: str, now: float, size: int) -> Callable[[], list[tuple[Any, ...]]]:
        """Priority by priority, the highest first, as the claim reads them."""
        x = self.db.execute
        found: list[tuple[Any, ...]] = []
        priority = x(_TOP_PRIORITY, (queue,)).fetchone()[0]
        while priority is not None and len(found) < size:
            params = {"queue": queue, "priority": priority, "now": now}
            found.extend(x(_READY_AT_GROUPS, {**params, "limit": size - len(found)}).fetchall())
            priority = x(_NEXT_PRIORITY, (queue, priority)).fetchone()[0]
        return found.copy

    def claim_picked(
        self,
        queue: str,
        owner: str,
        lease_until: float,
        now: float,
        picked: Sequence[tuple[int, str | None]],
        rated: Sequence[str],
    ) -> Callable[[], list[Claimed]]:
        x = self.db.execute
        ids = json.dumps([request_id for request_id, _ in picked])
        rows = [tuple(row) for row in x(_CLAIM_IDS, (owner, lease_until, ids, now, owner))]
        for reason, count in collections.Counter(row[7] for row in rows if row[7]).items():
            x(_STATEMENTS.count_rescues, (queue, reason, count))
        taken = {row[0] for row in rows}
        rated_set = set(rated)
        started = [g for i, g in picked if i in taken and g is not None and g in rated_set]
        if started:
            x(_RECORD_STARTS, (queue, now, json.dumps(started)))
        return rows.copy

    # SQLite answers each statement as it is asked: claim_limited reads and walks here.
    claim_by_groups = None

    def group_candidates(
        self, queue: str, now: float, rooms: Sequence[tuple[str, int]], default_room: int
    ) -> Callable[[], list[tuple[Any, ...]]]:
        """The groups one probe each, then a statement or two per group: in the process,
        each costs an index probe. (A group whose due rows are read needs no first row: the
        claim reads the first rows only to count the groups, and walks the due ones.)"""
        x = self.db.execute
        room_of = dict(rooms)
        found: list[tuple[Any, ...]] = []
        for (group,) in x(_STATEMENTS.ready_groups, (queue, queue)).fetchall():
            room = room_of.get(group, default_room)
            due = x(_GROUP_HEAD, (queue, group, now, room)).fetchall() if room > 0 else []
            if not due:
                found.extend(x(_GROUP_HEAD, (queue, group, math.inf, 1)).fetchall())
            found.extend(due)
        return found.copy


def _connect_read_only(path: Path, **options: Any) -> sqlite3.Connection:
    """A connection that can only read the file (``mode=ro``): it creates no file, no
    table, and leaves the journal mode as it is. Raises sqlite3.Error."""
    db: sqlite3.Connection = sqlite3.connect(
        f"{path.resolve().as_uri()}?mode=ro", uri=True, **options
    )
    return db


def _open_read_only(path: Path) -> sqlite3.Connection:
    """The file opened read-only, its tickler schema checked (none is created or migrated).

    Raises:
        StoreError: the file is missing, not a SQLite database, holds no tickler tables,
            or a schema of another version than SCHEMA_VERSION.
    """
    if not path.is_file():
        raise StoreError(f"{path}: no such file (a read-only admin creates none)")
    try:
        db = _connect_read_only(path, check_same_thread=False, isolation_level=None, timeout=60)
    except sqlite3.Error as exc:
        raise StoreError(f"cannot open {path} read-only: {exc}") from None
    try:
        _check_schema_read_only(db, path)
    except BaseException:
        db.close()
        raise
    return db


def _tables(db: sqlite3.Connection, path: Path) -> set[str]:
    """The names of the file's tables (and indexes, views, triggers).

    Raises:
        StoreError: the file is not a SQLite database.
    """
    try:
        return {row[0] for row in db.execute("SELECT name FROM sqlite_master")}
    except sqlite3.DatabaseError as exc:
        raise StoreError(f"{path} is not a SQLite database ({exc})") from None


def _check_schema_read_only(db: sqlite3.Connection, path: Path) -> None:
    if "tickler_schema" not in _tables(db, path):
        raise StoreError(
            f"{path} has no tickler tables yet, and a read-only admin creates none: start"
            " a service on it, or call store.create_schema()"
        )
    row = db.execute("SELECT version FROM tickler_schema").fetchone()
    if row is None or row[0] != SCHEMA_VERSION:
        raise StoreError(
            f"{path} has tickler schema version {row and row[0]}; a read-only admin reads"
            f" version {SCHEMA_VERSION} and migrates nothing: start a service of this"
            " tickler on it, or call store.create_schema(), to bring it up to date"
        )


def _check_schema(db: sqlite3.Connection, path: Path) -> None:
    """Create tickler's tables in the file, or check (and migrate) the ones it holds."""
    tables = _tables(db, path)
    if "tickler_schema" not in tables:
        # The application's own tables may share the file (enqueue_in
        # writes in its transactions), but not tables named as tickler's.
        clashing = sorted(name for name in tables if name.startswith("tickler_"))
        if clashing:
            raise StoreError(
                f"{path} holds {', '.join(clashing)} but no tickler_schema: a foreign schema"
                " under tickler's names"
            )
        db.execute("BEGIN IMMEDIATE")
        try:
            # Another process may have created it meanwhile.
            if db.execute("SELECT 1 FROM sqlite_master WHERE name = 'tickler_schema'").fetchone():
                db.execute("COMMIT")
            else:
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        db.execute(statement)
                _to_v4(db)
                _to_v5(db)
                _add_trace_context(db)
                _to_v7(db)
                _to_v8(db)
                db.execute("INSERT INTO tickler_schema VALUES (?)", (SCHEMA_VERSION,))
                db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
    row = db.execute("SELECT version FROM tickler_schema").fetchone()
    if row is not None and row[0] in _MIGRATIONS:
        row = _migrate(db)
    if row is None or row[0] != SCHEMA_VERSION:
        raise StoreError(
            f"{path} has tickler schema version {row and row[0]}; this tickler reads"
            f" version {SCHEMA_VERSION}"
        )


def _migrate(db: sqlite3.Connection) -> tuple[int]:
    """Bring an older schema to SCHEMA_VERSION, one version at a time, in one transaction."""
    db.execute("BEGIN IMMEDIATE")
    try:
        # Read again under the write lock: another process may have migrated.
        (version,) = db.execute("SELECT version FROM tickler_schema").fetchone()
        while version in _MIGRATIONS:
            _MIGRATIONS[version](db)
            version += 1
        db.execute("UPDATE tickler_schema SET version = ?", (version,))
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    return (version,)


_FAILURES = (
    "SELECT id, attempts, error_type, error_message FROM tickler_requests"
    " WHERE queue = ? AND state = 'failed' ORDER BY finished_at DESC LIMIT ?"
)


def inspect(path: Path, latest: int) -> dict[str, QueueReport]:
    """Each queue of the file: its counts, ``latest`` failures and paused flag, read without
    writing.

    Raises:
        ValueError: the file is missing, or not a tickler store of a version this reads.
    """
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    try:
        db = _connect_read_only(path)
    except sqlite3.Error as exc:
        raise ValueError(f"{path}: cannot open it ({exc})") from None
    try:
        try:
            version = db.execute("SELECT version FROM tickler_schema").fetchone()
        except sqlite3.DatabaseError:
            raise ValueError(f"{path}: not a tickler store") from None
        # An older version reads the same, but for the paused flags, which it has none of.
        if version is None or (version[0] != SCHEMA_VERSION and version[0] not in _MIGRATIONS):
            raise ValueError(f"{path}: tickler schema version {version and version[0]} unknown")
        return report(
            db.execute,
            _FAILURES,
            latest,
            paused=version[0] >= 3,
            groups=_STATEMENTS.busiest_groups if version[0] >= 4 else None,
            rescues=version[0] >= 5,
        )
    finally:
        db.close()


def set_paused(path: Path, queue: str, paused: bool) -> list[str]:
    """Pause a queue of the file, or resume it, for every process: a paused queue's services
    claim nothing, while what they run goes on. An older schema is brought up to date.
    Returns the queues the store knew before, by name (as ``Admin.queues()``).

    Raises:
        ValueError: the file is missing, not a tickler store, or of a version this does
            not know; or ``queue`` is not a queue name.
    """
    check_queue_name(queue, "queue")
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    try:
        db = _connect_read_only(path)
        try:
            db.execute("SELECT version FROM tickler_schema").fetchone()
        finally:
            db.close()
    except sqlite3.Error:
        raise ValueError(f"{path}: not a tickler store") from None
    try:
        session = SqliteSession(SqliteStore(path))
    except StoreError as exc:
        raise ValueError(str(exc)) from None
    try:
        session.begin()
        try:
            known = sorted(str(name) for (name,) in session.execute(KNOWN_QUEUES, ()))
            session.execute(_STATEMENTS.set_paused, (queue, bool(paused)))
            session.commit()
        except BaseException:
            session.rollback()
            raise
    finally:
        session.close()
    return known
