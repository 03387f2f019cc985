"""PostgresStore: one queue shared by many replicas, in a PostgreSQL schema.

The batch is the script of _sql.run_batch, over PostgreSQL's dialect,
PostgresSession: psycopg 3's synchronous connections on the service's
worker thread, in pipeline mode; claims with FOR UPDATE SKIP LOCKED; a
NOTIFY per batch that enqueues; and a reconnect when the server went away.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import attrs

from .._codec import Codec, check_queue_name
from .._exceptions import StoreError
from .._states import FINAL, LIVE, READY, sql_in
from .._values import Insert, Outcome, OutcomeKind
from ._admin import Admin
from ._pg_listen import Listener
from ._pg_live import BATCH_LOCK, LIVE_OWNERS, LOCK_KEY, Liveness
from ._seam import Batch, BatchResult, Row
from ._sql import (
    COUNTED_STATE,
    INSERT_COLUMNS,
    OUTCOME_VALUES,
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

if TYPE_CHECKING:
    import psycopg

logger = logging.getLogger("tickler")

# The version of the tables below.
SCHEMA_VERSION = 9

_T = TypeVar("_T")

# A schema's name also names its NOTIFY channel, "tickler_" + schema, which
# PostgreSQL caps at 63 bytes.
_IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]{0,54}$")

_SCHEMA = """
CREATE TABLE tickler_schema (version INTEGER NOT NULL);
CREATE TABLE tickler_requests (
    id BIGSERIAL PRIMARY KEY,
    queue TEXT NOT NULL,
    key TEXT,
    state TEXT NOT NULL,
    request BYTEA NOT NULL,
    result BYTEA,
    error_type TEXT,
    error_message TEXT,
    error_traceback TEXT,
    attempts INTEGER NOT NULL DEFAULT 0,
    run_at DOUBLE PRECISION NOT NULL,
    enqueued_at DOUBLE PRECISION NOT NULL,
    started_at DOUBLE PRECISION,
    finished_at DOUBLE PRECISION,
    owner TEXT,
    lease_until DOUBLE PRECISION,
    cancel_requested BOOLEAN NOT NULL DEFAULT FALSE,
    priority INTEGER NOT NULL DEFAULT 0,
    unique_until DOUBLE PRECISION
) WITH (
    -- A queue's rows are updated a few times and deleted: vacuum it early.
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.02,
    fillfactor = 70
);
CREATE UNIQUE INDEX tickler_live_keys ON tickler_requests (queue, key)
    WHERE key IS NOT NULL AND state IN ('queued', 'scheduled', 'running', 'retrying');
-- lookup(key) of a finished request, which the index of live keys does not hold.
CREATE INDEX tickler_keys ON tickler_requests (queue, key) WHERE key IS NOT NULL;
CREATE INDEX tickler_running ON tickler_requests (queue, lease_until)
    WHERE state = 'running';
CREATE INDEX tickler_finished ON tickler_requests (finished_at)
    WHERE state IN ('succeeded', 'failed', 'cancelled');
{_V2};
{_V3};
{_V4};
{_TRACE_CONTEXT};
{_RESCUES};
{_IDLE_BY_GROUP};
{_OWNERS_WHEREABOUTS};
{_LEANER_WRITES}
"""

# Version 2, from version 1: each row's priority and the time until which it holds its
# key (NULL: no hold); the claim index in the claim's order, the higher priority first;
# each queue's paused flag; the last tick of each periodic request. Each step is skipped
# where the schema already has it. (The index is built under a lock that holds writes
# back until it is done.)
_TO_V2 = """
ALTER TABLE tickler_requests ADD COLUMN IF NOT EXISTS priority INTEGER NOT NULL DEFAULT 0;
ALTER TABLE tickler_requests ADD COLUMN IF NOT EXISTS unique_until DOUBLE PRECISION;
DROP INDEX IF EXISTS tickler_ready;
"""

_V2 = """
CREATE INDEX tickler_ready ON tickler_requests (queue, priority DESC, run_at, id)
    WHERE state IN ('queued', 'scheduled', 'retrying');
CREATE TABLE IF NOT EXISTS tickler_queues (
    queue TEXT PRIMARY KEY,
    paused BOOLEAN NOT NULL DEFAULT FALSE
);
CREATE TABLE IF NOT EXISTS tickler_periodic (
    queue TEXT NOT NULL,
    name TEXT NOT NULL,
    last_tick DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (queue, name)
)
"""

# Version 3, from version 2: each row's group, and the index of ready rows by group, in
# claim order within each group (a group's first ready rows, the rows of no group, and
# the groups that have ready rows, one probe each, are read on it; a group's running rows
# are counted on tickler_running); the recent starts of rate-limited groups, deleted once
# older than the longest window of the limits; each queue's limits as its last batch
# gave them (JSON). Each step is skipped where the schema already has it.
_V3 = """
ALTER TABLE tickler_requests ADD COLUMN IF NOT EXISTS group_name TEXT;
ALTER TABLE tickler_queues ADD COLUMN IF NOT EXISTS limits TEXT;
CREATE INDEX IF NOT EXISTS tickler_groups
    ON tickler_requests (queue, group_name, priority DESC, run_at, id)
    WHERE state IN ('queued', 'scheduled', 'retrying');
CREATE TABLE IF NOT EXISTS tickler_starts (
    queue TEXT NOT NULL,
    group_name TEXT NOT NULL,
    started_at DOUBLE PRECISION NOT NULL
);
CREATE INDEX IF NOT EXISTS tickler_starts_by_group
    ON tickler_starts (queue, group_name, started_at)
"""

# Version 4, from version 3: the indexes the admin API reads on (tickler._stores._admin):
# each queue's rows by state, newest first (pages, counts, the queues); and the rows
# finished, by queue and time, holding what the overview reads of them (a group's rows
# are version 7's). A step of its own, skipped where the schema already has it. (Each
# index is built under a lock that holds writes back until it is done.)
_V4 = """
CREATE INDEX IF NOT EXISTS tickler_by_state ON tickler_requests (queue, state, id);
CREATE INDEX IF NOT EXISTS tickler_finished_by_queue ON tickler_requests (queue, finished_at)
    INCLUDE (state, run_at, started_at) WHERE finished_at IS NOT NULL;
{_MINUTES}
"""

# Version 4 also keeps the overview's finished requests per minute, which counting the
# rows of a busy hour (a million) would take too long for: each UPDATE that ends rows
# SUCCEEDED or FAILED adds them to their minute's row, one row per (queue, minute,
# owner) so that replicas never write the same row. One statement-level trigger per
# UPDATE, reading its rows from the transition tables; a statement ending none writes
# nothing. A replica's first finish of a minute drops rows two hours old (those locked
# by another's are left to the next). The rows finished within the last two hours are
# counted in on creation (owner '').
_MINUTES = """
CREATE TABLE IF NOT EXISTS tickler_minutes (
    queue TEXT NOT NULL,
    minute BIGINT NOT NULL,
    owner TEXT NOT NULL,
    succeeded BIGINT NOT NULL,
    failed BIGINT NOT NULL,
    PRIMARY KEY (queue, minute, owner)
);
CREATE OR REPLACE FUNCTION tickler_count_finished() RETURNS trigger LANGUAGE plpgsql
SET search_path FROM CURRENT AS $$
DECLARE
    newest BIGINT;
BEGIN
    -- Most statements (claims, starts, renewals) end nothing: they stop here.
    IF NOT EXISTS (SELECT FROM tickler_new WHERE state IN ('succeeded', 'failed')) THEN
        RETURN NULL;
    END IF;
    WITH ended AS (
        SELECT n.queue, floor(n.finished_at / 60)::int8 AS minute,
            coalesce(o.owner, '') AS owner,
            count(*) FILTER (WHERE n.state = 'succeeded') AS succeeded,
            count(*) FILTER (WHERE n.state = 'failed') AS failed
        FROM tickler_new AS n JOIN tickler_old AS o ON o.id = n.id
        WHERE n.state IN ('succeeded', 'failed') AND o.state NOT IN ('succeeded', 'failed')
            AND n.finished_at IS NOT NULL
        GROUP BY 1, 2, 3
    ), added AS (
        INSERT INTO tickler_minutes AS m (queue, minute, owner, succeeded, failed)
        SELECT * FROM ended
        ON CONFLICT (queue, minute, owner) DO UPDATE
            SET succeeded = m.succeeded + excluded.succeeded,
                failed = m.failed + excluded.failed
        RETURNING minute, xmax = 0 AS inserted
    )
    SELECT max(minute) INTO newest FROM added WHERE inserted;
    IF newest IS NOT NULL THEN
        DELETE FROM tickler_minutes WHERE ctid = ANY (ARRAY(
            SELECT ctid FROM tickler_minutes WHERE minute < newest - 120
            FOR UPDATE SKIP LOCKED));
    END IF;
    RETURN NULL;
END $$;
DROP TRIGGER IF EXISTS tickler_count_finished ON tickler_requests;
CREATE TRIGGER tickler_count_finished AFTER UPDATE ON tickler_requests
    REFERENCING OLD TABLE AS tickler_old NEW TABLE AS tickler_new
    FOR EACH STATEMENT EXECUTE FUNCTION tickler_count_finished();
{_BACKFILL}
"""

# The finished rows of the last two hours, counted into tickler_minutes (where none are).
BACKFILL_MINUTES = """
INSERT INTO tickler_minutes (queue, minute, owner, succeeded, failed)
SELECT queue, floor(finished_at / 60)::int8, '',
    count(*) FILTER (WHERE state = 'succeeded'), count(*) FILTER (WHERE state = 'failed')
FROM tickler_requests
WHERE finished_at >= extract(epoch FROM now()) - 7200 AND finished_at IS NOT NULL
    AND state IN ('succeeded', 'failed')
GROUP BY 1, 2
ON CONFLICT DO NOTHING
"""

_V4 = _V4.format(_MINUTES=_MINUTES.format(_BACKFILL=BACKFILL_MINUTES))

# The step that adds each row's trace context: the W3C traceparent and tracestate of the
# span that enqueued it (tickler.otel), read by the process that claims it. A step of its
# own, skipped where the schema already has it.
_TRACE_CONTEXT = """
ALTER TABLE tickler_requests ADD COLUMN IF NOT EXISTS traceparent TEXT;
ALTER TABLE tickler_requests ADD COLUMN IF NOT EXISTS tracestate TEXT
"""


# Version 6, from version 5: why and when each row was last rescued (claimed again while
# running: its owner's liveness lock was free, or its lease lapsed); each queue's rescues
# by reason; and the owners that took their liveness lock, with the time they took it
# (see _pg_live). Each step is skipped where the schema already has it.
_RESCUES = """
ALTER TABLE tickler_requests ADD COLUMN IF NOT EXISTS rescued TEXT;
ALTER TABLE tickler_requests ADD COLUMN IF NOT EXISTS rescued_at DOUBLE PRECISION;
CREATE TABLE IF NOT EXISTS tickler_rescues (
    queue TEXT NOT NULL,
    reason TEXT NOT NULL,
    count BIGINT NOT NULL,
    PRIMARY KEY (queue, reason)
);
CREATE TABLE IF NOT EXISTS tickler_owners (
    owner TEXT PRIMARY KEY,
    locked_at DOUBLE PRECISION NOT NULL
)
"""

# Version 7, from version 6: the admin API's index of a group's rows (pages, counts and
# bulk actions filtered by group, each state's rows newest first) leaves out the running
# rows, which tickler_running and tickler_by_state find (few: at most the capacities of
# the replicas). A claim then writes no entry into it, and an attempt's end one (serves:
# pg drain, grouped: each entry was about 3 µs of the server's time a request). Its
# readers name the state in the very words of a constant, so that a generic plan is
# proven to fit it (see _admin). Version 4 to 6 built it with the running rows: it is
# built again. (Under a lock that holds writes back until it is done.)
_IDLE_BY_GROUP = """
DROP INDEX IF EXISTS tickler_by_group;
CREATE INDEX tickler_by_group ON tickler_requests (queue, group_name, state, id)
    WHERE group_name IS NOT NULL AND state <> 'running'
"""

# Version 8, from version 7: each owner's host and process, recorded with its liveness
# lock (see _pg_live), which the admin lists as replicas; and the server's backend that
# holds the lock (NULL: a replica of an older tickler took it, and is not listed). A
# step of its own, skipped where the schema already has it.
_OWNERS_WHEREABOUTS = """
ALTER TABLE tickler_owners ADD COLUMN IF NOT EXISTS host TEXT;
ALTER TABLE tickler_owners ADD COLUMN IF NOT EXISTS pid INTEGER;
ALTER TABLE tickler_owners ADD COLUMN IF NOT EXISTS backend_pid INTEGER
"""

# Version 9, from version 8: fewer index entries for each request a drain writes (serves:
# pg drain, about 10 µs of the server's time a request). tickler_by_state leaves out the
# running rows, as version 7's tickler_by_group does: a claim writes no entry into it
# (its readers name the state as a constant; the running rows are read on
# tickler_running, and the queues known on both: see KNOWN_QUEUES_BY_STATE). The
# finished rows' index holds no started_at: the mark of an attempt's start then changes
# no indexed column, and is a HOT update where its page has room (the overview reads
# the start from the row). tickler_finished goes: the prune and the look at recent
# finals read tickler_finished_by_queue. (Each index is built under a lock that holds
# writes back until it is done.)
_LEANER_WRITES = """
DROP INDEX IF EXISTS tickler_finished;
DROP INDEX IF EXISTS tickler_by_state;
CREATE INDEX tickler_by_state ON tickler_requests (queue, state, id)
    WHERE state <> 'running';
DROP INDEX IF EXISTS tickler_finished_by_queue;
CREATE INDEX tickler_finished_by_queue ON tickler_requests (queue, finished_at)
    INCLUDE (state, run_at) WHERE finished_at IS NOT NULL;
{_COUNTED_BY_ROW}
"""

# Version 9 also counts the finished requests per minute (see _MINUTES) without a
# statement-level trigger: its transition tables copied every row of every UPDATE (the
# claims, the starts, the renewals), and it ran after each UPDATE of a batch, most of
# which end nothing (serves: pg drain, about 6% of its time). A batch's outcome
# statement counts its own rows (see _outcome_sql), in a transaction that says so
# (COUNTED_HERE, set with the batch's first statement); any other UPDATE that ends a row
# SUCCEEDED or FAILED is counted by a row-level trigger, which only such a row fires (its
# WHEN is evaluated without calling it). Both write the same rows of tickler_minutes,
# one per (queue, minute, owner), and drop those two hours old at the first count of a
# minute (those locked by another's are left to the next).
COUNTED_HERE = "tickler.counted_here"
_COUNTED_BY_ROW = f"""
DROP TRIGGER IF EXISTS tickler_count_finished ON tickler_requests;
DROP FUNCTION IF EXISTS tickler_count_finished();
CREATE OR REPLACE FUNCTION tickler_count_finished_row() RETURNS trigger LANGUAGE plpgsql
SET search_path FROM CURRENT AS $$
DECLARE
    this_minute BIGINT := floor(NEW.finished_at / 60)::int8;
    inserted BOOLEAN;
BEGIN
    INSERT INTO tickler_minutes AS m (queue, minute, owner, succeeded, failed)
    VALUES (NEW.queue, this_minute, coalesce(OLD.owner, ''),
        CASE WHEN NEW.state = 'succeeded' THEN 1 ELSE 0 END,
        CASE WHEN NEW.state = 'failed' THEN 1 ELSE 0 END)
    ON CONFLICT (queue, minute, owner) DO UPDATE
        SET succeeded = m.succeeded + excluded.succeeded, failed = m.failed + excluded.failed
    RETURNING xmax = 0 INTO inserted;
    IF inserted THEN
        DELETE FROM tickler_minutes WHERE ctid = ANY (ARRAY(
            SELECT ctid FROM tickler_minutes WHERE minute < this_minute - 120
            FOR UPDATE SKIP LOCKED));
    END IF;
    RETURN NULL;
END $$;
DROP TRIGGER IF EXISTS tickler_count_finished_row ON tickler_requests;
CREATE TRIGGER tickler_count_finished_row AFTER UPDATE OF state ON tickler_requests
    FOR EACH ROW WHEN (NEW.state IN ('succeeded', 'failed')
        AND OLD.state NOT IN ('succeeded', 'failed') AND NEW.finished_at IS NOT NULL
        AND coalesce(current_setting('{COUNTED_HERE}', TRUE), '') <> 'on')
    EXECUTE FUNCTION tickler_count_finished_row()
"""  # noqa: S608 (constants only)
_LEANER_WRITES = _LEANER_WRITES.format(_COUNTED_BY_ROW=_COUNTED_BY_ROW)

_SCHEMA = _SCHEMA.format(
    _V2=_V2,
    _V3=_V3,
    _V4=_V4,
    _TRACE_CONTEXT=_TRACE_CONTEXT,
    _RESCUES=_RESCUES,
    _IDLE_BY_GROUP=_IDLE_BY_GROUP,
    _OWNERS_WHEREABOUTS=_OWNERS_WHEREABOUTS,
    _LEANER_WRITES=_LEANER_WRITES,
)

# From each older version, the statements that bring a schema to the next one.
_MIGRATIONS = {
    1: _TO_V2 + _V2,
    2: _V3,
    3: _V4,
    4: _TRACE_CONTEXT,
    5: _RESCUES,
    6: _IDLE_BY_GROUP,
    7: _OWNERS_WHEREABOUTS,
    8: _LEANER_WRITES,
}

# The states of the partial indexes above, in their very words, so that a
# query holding them is planned on the index.
_READY = sql_in(READY)
_LIVE_STATE = sql_in(LIVE)
_FINAL_STATE = sql_in(FINAL)

_LIVE_WHERE = f"SELECT id, state FROM tickler_requests WHERE queue = %s AND {_LIVE_STATE} AND"  # noqa: S608 (constants only)
_ROW = f"SELECT {ROW_COLUMNS} FROM tickler_requests"  # noqa: S608 (constants only)
# Locks the row until the transaction ends: a cancel commits before or after a batch
# that writes the row, never in between.
_FOR_UPDATE = " FOR UPDATE"

_SET_PAUSED = (
    "INSERT INTO tickler_queues (queue, paused) VALUES (%s, %s)"
    " ON CONFLICT (queue) DO UPDATE SET paused = excluded.paused"
)


# Every queue the store knows, as KNOWN_QUEUES, on indexes that hold them: the queues of
# rows not running one probe each of tickler_by_state (a loose index scan), and those of
# the running rows on tickler_running.
KNOWN_QUEUES_BY_STATE = (
    "WITH RECURSIVE q(name) AS ("
    " SELECT min(queue) FROM tickler_requests WHERE state <> 'running'"
    " UNION ALL SELECT (SELECT min(queue) FROM tickler_requests"
    " WHERE state <> 'running' AND queue > q.name)"
    " FROM q WHERE q.name IS NOT NULL)"
    " SELECT name FROM q WHERE name IS NOT NULL"
    " UNION SELECT queue FROM tickler_requests WHERE state = 'running'"
    " UNION SELECT queue FROM tickler_queues"
)

_STATEMENTS = Statements(
    # A keyed row, unless its key is held by a row whose unique_until has not come, or
    # live (the conflict with tickler_live_keys).
    insert=f"{INSERT_COLUMNS}"  # noqa: S608 (constants only)
    " SELECT %s, %s, %s, %s::bytea, %s::float8, %s::float8, %s::int4, %s::float8, %s::text"
    " WHERE NOT EXISTS (SELECT 1 FROM tickler_requests"
    " WHERE queue = %s AND key = %s AND key IS NOT NULL AND unique_until > %s)"
    f" ON CONFLICT (queue, key) WHERE key IS NOT NULL AND {_LIVE_STATE} DO NOTHING RETURNING id",
    holder_of_key="SELECT id FROM tickler_requests"  # noqa: S608 (constants only)
    f" WHERE queue = %s AND key = %s AND key IS NOT NULL AND ({_LIVE_STATE} OR unique_until > %s)"
    f" ORDER BY {_LIVE_STATE} DESC, id DESC LIMIT 1",
    renew="UPDATE tickler_requests SET lease_until = %s"
    " WHERE queue = %s AND state = 'running' AND owner = %s AND lease_until > 0",
    mine="SELECT id, cancel_requested FROM tickler_requests"
    " WHERE queue = %s AND state = 'running' AND owner = %s AND lease_until > 0",
    count_rescues="INSERT INTO tickler_rescues (queue, reason, count) VALUES (%s, %s, %s)"
    " ON CONFLICT (queue, reason) DO UPDATE SET count = tickler_rescues.count + excluded.count",
    end_cancelled_orphans="UPDATE tickler_requests"
    " SET state = 'cancelled', finished_at = %s, owner = NULL, lease_until = NULL"
    " WHERE queue = %s AND state = 'running' AND lease_until < %s AND owner <> %s"
    " AND cancel_requested",
    recent=f"SELECT id FROM tickler_requests WHERE queue = %s AND {_FINAL_STATE}"  # noqa: S608 (constants only)
    " AND finished_at >= %s",
    prune="DELETE FROM tickler_requests WHERE id IN ("  # noqa: S608 (constants only)
    f" SELECT id FROM tickler_requests WHERE queue = %s AND {_FINAL_STATE} AND finished_at < %s"
    " AND (unique_until IS NULL OR unique_until <= %s) LIMIT %s)",
    has="SELECT 1 FROM tickler_requests WHERE id = %s",
    row_by_id=f"{_ROW} WHERE queue = %s AND id = %s",
    set_trace="UPDATE tickler_requests SET traceparent = %s, tracestate = %s WHERE id = %s",
    traces_of="SELECT id, traceparent, tracestate, key, priority, group_name"
    " FROM tickler_requests WHERE id = ANY(%s)",
    row_by_key=f"{_ROW} WHERE queue = %s AND key = %s"
    " ORDER BY state NOT IN ('queued', 'scheduled', 'running', 'retrying'), id DESC LIMIT 1",
    live_by_id=f"{_LIVE_WHERE} id = %s{_FOR_UPDATE}",
    live_by_key=f"{_LIVE_WHERE} key = %s{_FOR_UPDATE}",
    ask_cancel="UPDATE tickler_requests SET cancel_requested = TRUE WHERE id = %s",
    cancel_now="UPDATE tickler_requests SET state = 'cancelled', finished_at = %s WHERE id = %s",
    # The running rows and the others apart, each read on an index that holds them
    # (tickler_running, tickler_by_state), the queue given once.
    counts="WITH q AS MATERIALIZED (SELECT %s::text AS name)"  # noqa: S608 (constants only)
    " SELECT s, count(*) FROM ("
    " SELECT state AS s FROM tickler_requests"
    " WHERE queue = (SELECT name FROM q) AND state <> 'running'"
    f" UNION ALL SELECT {COUNTED_STATE} FROM tickler_requests"
    " WHERE queue = (SELECT name FROM q) AND state = 'running') AS r GROUP BY s"
    " UNION ALL SELECT 'paused', CASE WHEN paused THEN 1 ELSE 0 END FROM tickler_queues"
    " WHERE queue = %s"
    " UNION ALL SELECT 'rescued_' || reason, count FROM tickler_rescues WHERE queue = %s",
    set_paused=_SET_PAUSED,
    tick_insert="INSERT INTO tickler_periodic (queue, name, last_tick) VALUES (%s, %s, %s)"
    " ON CONFLICT (queue, name) DO NOTHING RETURNING 1",
    tick_advance="UPDATE tickler_periodic SET last_tick = %s"
    " WHERE queue = %s AND name = %s AND last_tick < %s RETURNING 1",
    set_limits="INSERT INTO tickler_queues (queue, limits) VALUES (%s, %s)"
    " ON CONFLICT (queue) DO UPDATE SET limits = excluded.limits",
    limits_of="SELECT limits FROM tickler_queues WHERE queue = %s",
    paused="SELECT paused FROM tickler_queues WHERE queue = %s",
    # (on tickler_running: the running rows of the queue whose lease runs after now)
    running_groups="SELECT group_name, count(*) FROM tickler_requests"
    " WHERE queue = %s AND state = 'running' AND lease_until > %s AND group_name IS NOT NULL"
    " GROUP BY group_name",
    starts_since="SELECT group_name, started_at FROM tickler_starts"
    " WHERE queue = %s AND started_at > %s",
    prune_starts="DELETE FROM tickler_starts WHERE queue = %s AND started_at <= %s",
    ready_groups=f"""
WITH RECURSIVE g(name) AS (
    (SELECT group_name FROM tickler_requests
     WHERE queue = %s AND {_READY} AND group_name IS NOT NULL
     ORDER BY group_name LIMIT 1)
    UNION ALL
    SELECT (SELECT group_name FROM tickler_requests
            WHERE queue = %s AND {_READY} AND group_name > g.name
            ORDER BY group_name LIMIT 1)
    FROM g WHERE g.name IS NOT NULL
)
SELECT name FROM g WHERE name IS NOT NULL""",  # noqa: S608 (constants only)
    ungrouped_ready="SELECT id, priority, run_at, group_name FROM tickler_requests"  # noqa: S608 (constants only)
    f" WHERE queue = %s AND {_READY} AND group_name IS NULL"
    " AND run_at <= %s ORDER BY priority DESC, run_at, id LIMIT %s",
    expired_rows="SELECT id, priority, run_at, group_name FROM tickler_requests"
    " WHERE queue = %s AND state = 'running' AND lease_until < %s"
    " AND owner <> %s AND NOT cancel_requested ORDER BY lease_until LIMIT %s",
    # Group by group on tickler_groups, its entries alone (a count over the list may be
    # planned as a scan of the table).
    limited_count="SELECT coalesce(sum(c.n), 0) FROM unnest(%(groups)s::text[]) AS g(name)"  # noqa: S608 (constants only)
    " CROSS JOIN LATERAL (SELECT count(*) AS n FROM tickler_requests"
    f" WHERE queue = %(queue)s AND {_READY} AND group_name = g.name AND run_at <= %(now)s) AS c",
    # The same, each group's count and the whole stopped at cap.
    limited_upto="SELECT count(*) FROM (SELECT 1 FROM unnest(%(groups)s::text[]) AS g(name)"  # noqa: S608 (constants only)
    " CROSS JOIN LATERAL (SELECT 1 FROM tickler_requests"
    f" WHERE queue = %(queue)s AND {_READY} AND group_name = g.name AND run_at <= %(now)s"
    " LIMIT %(cap)s) AS c LIMIT %(cap)s) AS upto",
    busiest_groups=busiest_groups("%s", _LIVE_STATE),
    known_queues=KNOWN_QUEUES_BY_STATE,
)

# A limited claim's first look: the first rows due in claim order, whatever their group,
# read as the claim reads them (priority by priority), without locking them.
_READY_CHUNK = f"""
SELECT id, priority, due, group_name FROM (
    SELECT ready.id, ready.priority, ready.run_at AS due, ready.group_name FROM (
        WITH RECURSIVE level(p) AS (
            (SELECT priority FROM tickler_requests
             WHERE queue = %(queue)s AND {_READY}
             ORDER BY priority DESC LIMIT 1)
            UNION ALL
            SELECT (SELECT priority FROM tickler_requests
                    WHERE queue = %(queue)s AND {_READY} AND priority < level.p
                    ORDER BY priority DESC LIMIT 1)
            FROM level WHERE level.p IS NOT NULL
        )
        SELECT p FROM level WHERE p IS NOT NULL
    ) AS level
    CROSS JOIN LATERAL (
        SELECT id, priority, run_at, group_name FROM tickler_requests
        WHERE queue = %(queue)s AND {_READY} AND priority = level.p
            AND run_at <= %(now)s
        ORDER BY run_at, id LIMIT %(limit)s
    ) AS ready
) AS rows
ORDER BY priority DESC, due, id LIMIT %(limit)s
"""  # noqa: S608 (constants only)

# Every group that has ready rows, each with its first ready row in claim order: a
# recursive CTE named head, for _GROUP_CANDIDATES and _CLAIM_BY_GROUPS.
_HEADS = f"""head AS (
    (SELECT id, priority, run_at, group_name FROM tickler_requests
     WHERE queue = %(queue)s AND {_READY} AND group_name IS NOT NULL
     ORDER BY group_name, priority DESC, run_at, id LIMIT 1)
    UNION ALL
    SELECT next.* FROM head CROSS JOIN LATERAL (
        SELECT id, priority, run_at, group_name FROM tickler_requests
        WHERE queue = %(queue)s AND {_READY} AND group_name > head.group_name
        ORDER BY group_name, priority DESC, run_at, id LIMIT 1
    ) AS next
)"""  # noqa: S608 (constants only)

# Every group that has ready rows, found one at a time on tickler_groups, each with its first
# ready row in claim order (a loose index scan: each probe finds the next group and its first
# row at once); then, for each group whose room (its entry of the rooms given, else the
# default room) is more than one, or whose first row is not due, its first due rows, as many
# as its room. A group at its limit costs one probe.
_GROUP_CANDIDATES = f"""
WITH RECURSIVE {_HEADS}, want AS (
    SELECT head.*, coalesce(room.n, %(default_room)s::int8) AS n
    FROM head LEFT JOIN unnest(%(groups)s::text[], %(rooms)s::int8[]) AS room(name, n)
        ON room.name = head.group_name
)
SELECT id, priority, run_at, group_name FROM want
UNION ALL
SELECT more.id, more.priority, more.run_at, more.group_name
FROM want CROSS JOIN LATERAL (
    SELECT id, priority, run_at, group_name FROM tickler_requests
    WHERE queue = %(queue)s AND {_READY} AND group_name = want.group_name
        AND run_at <= %(now)s
    ORDER BY priority DESC, run_at, id LIMIT want.n
) AS more
WHERE want.n > 1 OR (want.n = 1 AND want.run_at > %(now)s)
"""  # noqa: S608 (constants only)

# A claim's rescues counted by reason, from its CTE claimed (_CLAIM, _CLAIM_PICKED,
# _CLAIM_BY_GROUPS).
_COUNTED = """counted AS (
    INSERT INTO tickler_rescues (queue, reason, count)
    SELECT %(queue)s, rescued_now, count(*) FROM claimed
    WHERE rescued_now IS NOT NULL GROUP BY rescued_now
    ON CONFLICT (queue, reason) DO UPDATE SET count = tickler_rescues.count + excluded.count
)"""


def _claimed(ids: str) -> str:
    """The CTE claimed of a limited claim: the rows of ``ids`` (SQL of an int8[]) still
    ready, or running with a lease lapsed (not this owner's, not asked to cancel), claimed
    and their rescues recorded; each as Dialect.claim gives it, and its group."""
    return f"""claimed AS (
    UPDATE tickler_requests SET state = 'running', owner = %(owner)s,
        lease_until = %(lease_until)s, attempts = attempts + 1, started_at = NULL,
        {RESCUE_SETS.format(now="%(now)s")}
    WHERE id = ANY({ids}) AND ({_READY}
        OR (state = 'running' AND lease_until < %(now)s AND owner <> %(owner)s
            AND NOT cancel_requested))
    RETURNING id, request, attempts, key, enqueued_at, run_at, priority, group_name,
        {RESCUE_RETURNED.format(now="%(now)s")} AS rescued_now
)"""  # noqa: S608 (constants only)


# A limited claim's rows, by id, and a start recorded for each of a rated group, and its
# rescues recorded and counted (as _CLAIM's): one statement, whose answer may be read once
# the batch has committed.
_CLAIM_PICKED = f"""
WITH {_claimed("%(ids)s::int8[]")}, started AS (
    INSERT INTO tickler_starts (queue, group_name, started_at)
    SELECT %(queue)s, group_name, %(now)s FROM claimed
    WHERE group_name = ANY(%(rated)s::text[])
), {_COUNTED}
SELECT id, request, attempts, key, enqueued_at, run_at, priority, rescued_now FROM claimed
"""  # noqa: S608 (constants only)

# A limited claim group by group, in one statement (serves: pg drain, grouped): what
# _sql.claim_limited reads, walks and claims in three statements and a round trip of its
# own, here asked with the batch's COMMIT. Every group that has ready rows is found one
# index probe each (as _GROUP_CANDIDATES finds them), with every group of a lapsed lease;
# each one's room is its limit (its entry of the named limits, else the default, if any)
# less its running rows whose lease has not run out and its starts within its window; the
# candidates are each group's first due rows, as many as its room, the due rows of no
# group and the lapsed leases; of those, in claim order, each group's first as many as its
# room, and the first `limit` of all (what _sql._walk picks from the same rows). The rows
# are claimed as _CLAIM_PICKED claims them, a start recorded for each of a rated group.
# Nothing while the queue is paused. Last comes one row more, its id NULL: how many due
# ready rows of the groups left at their limit wait (counted no further than cap, the
# rows just claimed left out), those groups, and how many groups have ready rows; then
# what _DUE_AND_LIVE asks, as of the claim: when the next ready row falls due (asked only
# where no due row is held back: the loop wakes for a row falling due only then; its
# probes pass over the index entries of the rows claimed since the last vacuum, serves:
# pg drain, grouped), whether anything is live, and whether the queue is paused.
_CLAIM_BY_GROUPS = f"""
WITH RECURSIVE {_HEADS}, paused AS (
    SELECT coalesce((SELECT paused FROM tickler_queues WHERE queue = %(queue)s), FALSE) AS p
), expired AS (
    SELECT id, priority, run_at, group_name FROM tickler_requests
    WHERE queue = %(queue)s AND state = 'running' AND lease_until < %(now)s
        AND owner <> %(owner)s AND NOT cancel_requested
    ORDER BY lease_until LIMIT %(limit)s
), running AS (
    SELECT group_name, count(*) AS n FROM tickler_requests
    WHERE queue = %(queue)s AND state = 'running' AND lease_until > %(now)s
        AND group_name IS NOT NULL
    GROUP BY group_name
), limits AS (
    SELECT g.name, n.name IS NOT NULL OR %(default)s AS limited,
        CASE WHEN n.name IS NOT NULL THEN n.concurrency ELSE %(concurrency)s::int8 END
            AS concurrency,
        CASE WHEN n.name IS NOT NULL THEN n.rate ELSE %(rate)s::int8 END AS rate,
        CASE WHEN n.name IS NOT NULL THEN n.per ELSE %(per)s::float8 END AS per
    FROM (SELECT group_name AS name FROM head
          UNION SELECT group_name FROM expired WHERE group_name IS NOT NULL) AS g
    LEFT JOIN unnest(%(names)s::text[], %(concurrencies)s::int8[], %(rates)s::int8[],
        %(pers)s::float8[]) AS n(name, concurrency, rate, per) ON n.name = g.name
), free AS (
    SELECT limits.name, limits.rate IS NOT NULL AS rated,
        limits.limited AND (limits.concurrency IS NOT NULL OR limits.rate IS NOT NULL)
            AS bounded,
        CASE WHEN limits.limited THEN greatest(0, least(
            limits.concurrency - coalesce(running.n, 0), limits.rate - started.n))
        END AS n
    FROM limits LEFT JOIN running ON running.group_name = limits.name
    LEFT JOIN LATERAL (
        SELECT count(*) AS n FROM tickler_starts
        WHERE queue = %(queue)s AND group_name = limits.name
            AND started_at > %(now)s - limits.per AND limits.rate IS NOT NULL
    ) AS started ON TRUE
), room AS (
    SELECT name, rated, bounded, n AS free,
        CASE WHEN bounded THEN least(n, %(limit)s) ELSE %(limit)s END AS n
    FROM free
), candidates AS (
    SELECT head.* FROM head JOIN room ON room.name = head.group_name
    WHERE room.n > 0 AND head.run_at <= %(now)s
    UNION ALL
    SELECT more.* FROM head JOIN room ON room.name = head.group_name CROSS JOIN LATERAL (
        SELECT id, priority, run_at, group_name FROM tickler_requests
        WHERE queue = %(queue)s AND {_READY} AND group_name = head.group_name
            AND run_at <= %(now)s AND id <> head.id
        ORDER BY priority DESC, run_at, id
        LIMIT CASE WHEN head.run_at <= %(now)s THEN room.n - 1 ELSE room.n END
    ) AS more
    WHERE room.n > 1 OR (room.n = 1 AND head.run_at > %(now)s)
    UNION ALL
    (SELECT id, priority, run_at, group_name FROM tickler_requests
     WHERE queue = %(queue)s AND {_READY} AND group_name IS NULL AND run_at <= %(now)s
     ORDER BY priority DESC, run_at, id LIMIT %(limit)s)
    UNION ALL
    SELECT * FROM expired
), picked AS (
    SELECT ranked.id FROM (
        SELECT candidates.*, row_number() OVER (
            PARTITION BY group_name ORDER BY priority DESC, run_at, id) AS k
        FROM candidates
    ) AS ranked LEFT JOIN room ON room.name = ranked.group_name
    WHERE (ranked.group_name IS NULL OR ranked.k <= room.n) AND NOT (SELECT p FROM paused)
    ORDER BY ranked.priority DESC, ranked.run_at, ranked.id LIMIT %(limit)s
), {_claimed("ARRAY(SELECT id FROM picked)")}, started AS (
    INSERT INTO tickler_starts (queue, group_name, started_at)
    SELECT %(queue)s, claimed.group_name, %(now)s
    FROM claimed JOIN room ON room.name = claimed.group_name
    WHERE room.rated
), {_COUNTED}, taken AS (
    SELECT group_name, count(*) AS n FROM claimed GROUP BY group_name
), blocked AS (
    SELECT room.name FROM room LEFT JOIN taken ON taken.group_name = room.name
    WHERE room.bounded AND room.free <= coalesce(taken.n, 0) AND NOT (SELECT p FROM paused)
), held AS (
    SELECT count(*) AS n FROM (
        SELECT 1 FROM blocked CROSS JOIN LATERAL (
            SELECT 1 FROM tickler_requests
            WHERE queue = %(queue)s AND {_READY} AND group_name = blocked.name
                AND run_at <= %(now)s AND id NOT IN (SELECT id FROM claimed)
            LIMIT %(cap)s
        ) AS c
        LIMIT %(cap)s
    ) AS upto
), due AS (
    SELECT CASE WHEN held.n = 0 THEN (
        WITH RECURSIVE level(p, due) AS (
            (SELECT priority, run_at FROM tickler_requests
             WHERE queue = %(queue)s AND {_READY} AND id NOT IN (SELECT id FROM claimed)
             ORDER BY priority DESC, run_at LIMIT 1)
            UNION ALL
            SELECT next.priority, next.run_at FROM level CROSS JOIN LATERAL (
                SELECT priority, run_at FROM tickler_requests
                WHERE queue = %(queue)s AND {_READY} AND priority < level.p
                    AND id NOT IN (SELECT id FROM claimed)
                ORDER BY priority DESC, run_at LIMIT 1
            ) AS next
        )
        SELECT min(due) FROM level
    ) END AS at
    FROM held
)
SELECT id, request, attempts, key, enqueued_at, run_at, priority, rescued_now,
    NULL::int8, NULL::text[], NULL::int8, NULL::float8, NULL::bool, NULL::bool
FROM claimed
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, held.n,
    ARRAY(SELECT name FROM blocked ORDER BY name), (SELECT count(*) FROM head), due.at,
    held.n > 0 OR due.at IS NOT NULL OR EXISTS (SELECT 1 FROM claimed) OR EXISTS (
        SELECT 1 FROM tickler_requests WHERE queue = %(queue)s AND state = 'running'
        ORDER BY lease_until DESC LIMIT 1),
    (SELECT p FROM paused)
FROM held, due
"""  # noqa: S608 (constants only)

# One statement per wake-up: the ready rows of the highest priority first,
# each priority's in the order they fell due, and the expired leases,
# skipping rows another replica is claiming at this instant; nothing while
# the queue is paused. The priorities that have ready rows are found one at a
# time on tickler_ready (queue, priority DESC, run_at, id), each the largest
# below the last (a loose index scan), and each one's due rows are read there
# in order, limited on their own, so that a claim reads about as many index
# entries as it claims, whatever is scheduled for later. The expired leases
# are ordered and limited on tickler_running: one WHERE with an OR of the two
# kinds would scan and sort every ready row. A lease of this replica's own
# that lapsed (the server was away longer than the lease) is never claimed by
# it again: its attempt still runs here, and the next look renews the lease
# (or hands back a row this replica never learned it held). A request whose
# cancel was asked for is never claimed again: the batch ends it CANCELLED
# instead (rechecked here, since a cancel can commit in between). The ids are
# picked first, as an array, so that the rows are then found by primary key:
# a join with the picked ids may be planned as a hash join over a scan of the
# whole table.
_NOT_PAUSED = "NOT EXISTS (SELECT 1 FROM tickler_queues WHERE queue = %(queue)s AND paused)"

_CLAIM = f"""
WITH claimed AS (
UPDATE tickler_requests AS t
SET state = 'running', owner = %(owner)s, lease_until = %(lease_until)s,
    attempts = t.attempts + 1, started_at = NULL,
    {RESCUE_SETS.format(now="%(now)s")}
WHERE t.id = ANY(ARRAY(
    SELECT id FROM (
        SELECT ready.id, ready.priority, ready.run_at AS due FROM (
            WITH RECURSIVE level(p) AS (
                (SELECT priority FROM tickler_requests
                 WHERE queue = %(queue)s AND {_READY} AND {_NOT_PAUSED}
                 ORDER BY priority DESC LIMIT 1)
                UNION ALL
                SELECT (SELECT priority FROM tickler_requests
                        WHERE queue = %(queue)s AND {_READY} AND priority < level.p
                        ORDER BY priority DESC LIMIT 1)
                FROM level WHERE level.p IS NOT NULL
            )
            SELECT p FROM level WHERE p IS NOT NULL
        ) AS level
        CROSS JOIN LATERAL (
            SELECT id, priority, run_at FROM tickler_requests
            WHERE queue = %(queue)s AND {_READY} AND priority = level.p
                AND run_at <= %(now)s
            ORDER BY run_at, id LIMIT %(limit)s
            FOR UPDATE SKIP LOCKED
        ) AS ready
        UNION ALL
        SELECT id, priority, run_at FROM (
            SELECT id, priority, run_at FROM tickler_requests
            WHERE queue = %(queue)s AND state = 'running' AND lease_until < %(now)s
                AND owner <> %(owner)s AND NOT cancel_requested AND {_NOT_PAUSED}
            ORDER BY lease_until LIMIT %(limit)s
            FOR UPDATE SKIP LOCKED
        ) AS expired
    ) AS both_kinds
    ORDER BY priority DESC, due, id LIMIT %(limit)s
))
RETURNING t.id, t.request, t.attempts, t.key, t.enqueued_at, t.run_at, t.priority,
    {RESCUE_RETURNED.format(now="%(now)s")} AS rescued_now
), {_COUNTED}
SELECT * FROM claimed
"""  # noqa: S608 (constants only)

# The first statement of a batch's transaction (see _pg_live.BATCH_LOCK).
# It also says that the batch's outcome statements count the rows they finish themselves
# (see _COUNTED_BY_ROW): the row-level trigger passes over them (serves: pg drain).
_BATCH_LOCK = (
    f"SELECT pg_advisory_xact_lock_shared({BATCH_LOCK}, %s),"
    f" set_config('{COUNTED_HERE}', 'on', TRUE)"
)

# The leases of the queue's running rows whose owner's liveness lock is free lapse at
# once (see _pg_live): the owners that took their lock since the server started, but
# this one, whose lock this transaction can take; as many rows as the claim that follows
# takes (the others keep their lease until a claim has room). The lock is tried only for those
# owners (CASE orders the tests): one that has not taken its lock again since a restart
# must find it free when it does. Rows another transaction is claiming are skipped.
_MARK_DEAD = f"""
UPDATE tickler_requests SET lease_until = -%s::float8
WHERE id IN (
    SELECT id FROM tickler_requests
    WHERE queue = %s AND state = 'running' AND lease_until > 0 AND owner IN (
        SELECT owner FROM tickler_owners
        WHERE owner <> %s AND CASE
            WHEN locked_at > extract(epoch FROM pg_postmaster_start_time())
            THEN pg_try_advisory_xact_lock({LOCK_KEY.format(owner="owner")})
            ELSE FALSE END
    )
    ORDER BY lease_until LIMIT %s
    FOR UPDATE SKIP LOCKED
)
"""  # noqa: S608 (constants only)

# When the next ready row falls due (the earliest run_at of each priority,
# found as the claim finds them), whether anything is live, and whether the
# queue is paused, in one statement, each part on its index: an EXISTS over
# the ready states may be planned as a sequential scan, which reads every
# finished row ahead of the first ready one. Each index probe passes over the
# entries that rows claimed since the last vacuum left behind, ahead of the
# first ready row of each priority on tickler_ready, and of the running rows
# on tickler_running (serves: pg drain, both rows, whose batches ask it but
# for the limited claims group by group, which answer it themselves): the
# probe that finds a priority gives its earliest run_at too (the first of its
# entries, in run_at order), and a running row is looked for from the latest
# lease, where the rows that run now have theirs.
_DUE_AND_LIVE = f"""
SELECT (
    WITH RECURSIVE level(p, due) AS (
        (SELECT priority, run_at FROM tickler_requests
         WHERE queue = %(queue)s AND {_READY}
         ORDER BY priority DESC, run_at LIMIT 1)
        UNION ALL
        SELECT next.priority, next.run_at FROM level CROSS JOIN LATERAL (
            SELECT priority, run_at FROM tickler_requests
            WHERE queue = %(queue)s AND {_READY} AND priority < level.p
            ORDER BY priority DESC, run_at LIMIT 1
        ) AS next
    )
    SELECT min(due) FROM level
), (
    SELECT 1 FROM tickler_requests
    WHERE queue = %(queue)s AND state = 'running'
    ORDER BY lease_until DESC LIMIT 1
) IS NOT NULL, coalesce((SELECT paused FROM tickler_queues WHERE queue = %(queue)s), FALSE)
"""  # noqa: S608 (constants only)

# The transaction's time; and the same once the limited claims' advisory lock of a queue
# (see PostgresSession.lock_limited) is held, in one statement: the lock is taken as the
# CTE is read, before the clock is.
_NOW = "SELECT extract(epoch FROM clock_timestamp())::float8"
_LOCKED_NOW = (
    "WITH locked AS MATERIALIZED (SELECT pg_advisory_xact_lock(hashtextextended(%s, 0)))"
    " SELECT extract(epoch FROM clock_timestamp())::float8 FROM locked"
)

_STARTED = (
    "UPDATE tickler_requests SET started_at = %s WHERE id = ANY(%s::int8[])"
    " AND owner = %s AND state = 'running' AND started_at IS NULL"
)

_FINALS = f"{_ROW} WHERE id = ANY(%s::int8[]) AND {_FINAL_STATE}"

# The SQL type of each value an outcome writes (see _sql.run_batch), after
# the id and before the batch's time: the arrays unnest() reads them from.
_OUTCOME_TYPES = {
    OutcomeKind.SUCCEEDED: ("bytea", "float8"),
    OutcomeKind.RETRYING: ("float8", "text", "text", "text"),
    OutcomeKind.FAILED: ("float8", "text", "text", "text"),
    OutcomeKind.CANCELLED: ("float8",),
    OutcomeKind.HANDED_BACK: ("float8",),
    OutcomeKind.RETURNED: ("float8",),
}


@functools.cache
def _outcome_sql(kind: OutcomeKind) -> str:
    """One UPDATE for every outcome of a kind: one text, prepared once, whatever their number.

    The arrays go in PostgreSQL's binary format (%b), which psycopg writes about five
    times faster than their text (serves: pg drain: 0.6 ms against 0.12 ms for the
    arrays of 100 outcomes)."""
    types = ("int8", *_OUTCOME_TYPES[kind], "int4", "float8")
    columns = ", ".join(f"column{i}" for i in range(1, len(types) + 1))
    arrays = ", ".join(f"%b::{t}[]" for t in types)
    sets = SETS[kind].format(now=f"v.column{len(types)}")
    attempt = f"v.column{len(types) - 1}"
    update = (
        f"UPDATE tickler_requests SET {sets}, owner = NULL, lease_until = NULL"  # noqa: S608
        f" FROM unnest({arrays}) AS v({columns})"
        " WHERE tickler_requests.id = v.column1 AND owner = %s AND state = 'running'"
        f" AND ({attempt} IS NULL OR attempts = {attempt})"
        " RETURNING tickler_requests.id, state"
    )
    if kind not in _COUNTED_KINDS:
        return update
    return (
        f"WITH ended AS ({update}, queue, finished_at),"  # noqa: S608 (constants only)
        f" {_COUNT_ENDED} SELECT id, state FROM ended"
    )


# The outcomes that may end a row SUCCEEDED or FAILED, which their statement counts into
# tickler_minutes itself (see _COUNTED_BY_ROW; serves: pg drain): the rows of its CTE
# ended, by queue and minute, under the owner (its parameter, after the UPDATE's); the
# first count of a minute drops the rows two hours old, as the trigger does.
_COUNTED_KINDS = frozenset({OutcomeKind.SUCCEEDED, OutcomeKind.FAILED})
_COUNT_ENDED = """counted AS (
    INSERT INTO tickler_minutes AS m (queue, minute, owner, succeeded, failed)
    SELECT queue, floor(finished_at / 60)::int8, %s,
        count(*) FILTER (WHERE state = 'succeeded'), count(*) FILTER (WHERE state = 'failed')
    FROM ended WHERE state IN ('succeeded', 'failed') AND finished_at IS NOT NULL
    GROUP BY 1, 2
    ON CONFLICT (queue, minute, owner) DO UPDATE
        SET succeeded = m.succeeded + excluded.succeeded, failed = m.failed + excluded.failed
    RETURNING minute, xmax = 0 AS inserted
), dropped AS (
    DELETE FROM tickler_minutes WHERE ctid = ANY (ARRAY(
        SELECT ctid FROM tickler_minutes
        WHERE minute < (SELECT max(minute) - 120 FROM counted WHERE inserted)
        FOR UPDATE SKIP LOCKED))
)"""


# A server host that vanishes without closing its connections (no FIN, no
# RST) would leave a read waiting for ever: TCP keepalives find it within
# about 25 seconds, and the batch is retried. A DSN's own settings win.
_KEEPALIVES = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
}


def _open_connection(dsn: str, application_name: str | None = None) -> psycopg.Connection[Any]:
    """A connection in autocommit, with TCP keepalives unless the DSN sets its own (and
    ``application_name``, unless the DSN names one)."""
    import psycopg
    import psycopg.conninfo

    given = psycopg.conninfo.conninfo_to_dict(dsn)
    keepalives: dict[str, Any] = {
        key: value for key, value in _KEEPALIVES.items() if key not in given
    }
    if application_name is not None and "application_name" not in given:
        keepalives["application_name"] = application_name
    return psycopg.connect(dsn, autocommit=True, connect_timeout=10, **keepalives)


class PostgresStore:
    """A durable queue in a PostgreSQL schema, shared by every replica that uses it.

    Each request is a row of the table ``<schema>.tickler_requests``. Its
    ``key`` column holds the request's key as canonical JSON, ASCII only:
    ``json.dumps(key, separators=(",", ":"))``, so the str key ``k`` is the
    text ``"k"`` (quotes included) and the tuple ``("order", 7)`` is
    ``["order",7]``; NULL for a request without a key. A row inserted by
    another driver de-duplicates against ``enqueue_in`` and the services
    only if its key is encoded so. An encoded key is at most MAX_KEY_BYTES
    (1,000) bytes and a queue name at most MAX_QUEUE_BYTES (1,000) bytes in
    UTF-8, so that both fit one entry of PostgreSQL's index of live keys;
    longer ones are refused with ValueError.

    The schema and its tables are created when a service first connects,
    or by ``create_schema()``.

    Args:
        dsn: a libpq connection string or URL.
        lease: seconds a claimed request stays leased; renewed every
            ``lease / 3`` while it runs.
        poll_interval: seconds between looks for work, cancels and outcomes
            from other replicas (NOTIFY wakes the loop sooner).
        notify: send NOTIFY after a batch that enqueues; False for a pooler
            in transaction mode, which then relies on polling.
        schema: the schema holding tickler's tables, created on first use.
        retention: seconds a final request is kept before it is deleted.
    """

    def __init__(
        self,
        dsn: str,
        *,
        lease: float = 30.0,
        poll_interval: float = 1.0,
        notify: bool = True,
        schema: str = "tickler",
        retention: float = 86400.0,
    ) -> None:
        if not isinstance(dsn, str):
            raise TypeError("dsn must be a str")
        if not isinstance(notify, bool):
            raise TypeError("notify must be a bool")
        if not isinstance(schema, str) or not _IDENTIFIER.match(schema):
            raise ValueError(
                "schema must be a lower-case SQL identifier: letters, digits and _, at most 55"
            )
        self.dsn = dsn
        self.lease = seconds("lease", lease)
        self.poll_interval = seconds("poll_interval", poll_interval)
        self.notify = notify
        self.schema = schema
        self.retention = seconds("retention", retention, allow_zero=True)
        self._codecs: dict[str, Codec] = {}
        # tickler.otel's, while enqueue_in and enqueue_many_in are traced.
        self._tracer: EnqueueTracer | None = None
        self._enqueue_sql: tuple[str, str] | None = None  # (insert, holders)
        self._enqueue_one_sql: str | None = None

    def __repr__(self) -> str:
        return f"tickler.PostgresStore(schema={self.schema!r})"

    def connect(self) -> PostgresSession:
        """Connect, creating or checking the schema. Blocking: call it on a thread."""
        return PostgresSession(self)

    def admin(self, *, read_only: bool = False) -> Admin:
        """The admin API on every queue of the schema, with no service running.

        Its methods are async; it opens its own connection (one) at its first call
        (creating or upgrading the schema, as a service does) and closes it at
        ``aclose()``.

        Args:
            read_only: a read-only session (``default_transaction_read_only``) that
                creates, migrates and writes nothing: a role with USAGE on the schema and
                SELECT on its tables is enough. Each method that would write raises
                PermissionError. Its first call raises StoreError if the schema holds no
                tickler tables yet, or a schema of another version (it is not brought up
                to date).
        """
        if not isinstance(read_only, bool):
            raise TypeError("read_only must be a bool")
        return Admin(
            repr(self),
            functools.partial(PostgresSession, self, admin=True, read_only=read_only),
            self._codecs,
            self.lease,
            read_only=read_only,
        )

    def create_schema(self) -> None:
        """Create the schema and tickler's tables in it, unless they exist.

        A service creates them when it starts; call this first to enqueue
        with ``enqueue_in`` before any service has run on the schema.
        Calling it again does nothing; replicas calling it at once create
        the tables once. It opens a connection of its own and closes it.
        Blocking: in a Trio program, call it through
        ``trio.to_thread.run_sync(store.create_schema)``.

        Raises:
            StoreError: the server cannot be reached, the schema holds
                tables that are not tickler's, or another schema version.
        """
        PostgresSession(self).close()

    def enqueue_in(
        self,
        connection: psycopg.Connection[Any],
        queue: str,
        request: object,
        *,
        key: object = None,
        delay: float | None = None,
        priority: int = 0,
        unique_for: float | None = None,
        group: str | None = None,
    ) -> int:
        """Write a request through the caller's psycopg connection, in its open transaction.

        The request exists if and only if the caller commits; on a
        connection in autocommit mode, it is committed at once.

        Args:
            priority: higher runs first: among ready requests, the highest
                priority is claimed first, then the earliest due. An int in
                PostgreSQL's integer range.
            unique_for: seconds the key stays taken after this enqueue, even
                once the request is final (``math.inf``: for ever); retention
                keeps the row until then. Needs ``key``.
            group: the request's group, whose limits (a service's ``limits``) apply to
                it across every replica; None: no group, never limited. A str of 1 to
                200 bytes in UTF-8, without NUL.

        Returns:
            The new request's id, or the id of the request holding ``key``: its
            live request, else the latest whose ``unique_for`` has not run out.

        Raises:
            StoreError: the schema has no tickler tables yet: call
                ``create_schema()`` first, or start a service on the store.
                The failed statement has aborted the caller's transaction,
                which must be rolled back.
            ValueError: ``queue`` is over MAX_QUEUE_BYTES, or the encoded
                ``key`` over MAX_KEY_BYTES (see the class's note on keys);
                ``priority`` or ``unique_for`` out of range, or ``unique_for``
                without ``key``.
            TypeError: ``priority`` is not an int, ``unique_for`` not a number,
                ``group`` not a str.
        """
        keyed = None if key is None else (lambda _: key)
        prepared = prepare_enqueue(
            self._codecs, queue, [request], keyed, delay, priority, unique_for, group
        )
        return self._traced(connection, queue, prepared)[0]

    def enqueue_many_in(
        self,
        connection: psycopg.Connection[Any],
        queue: str,
        requests: Iterable[object],
        *,
        key: Callable[[Any], object] | None = None,
        delay: float | None = None,
        priority: int = 0,
        unique_for: float | None = None,
        group: str | None = None,
    ) -> list[int]:
        """Write many requests through the caller's psycopg connection, in its open
        transaction, in one statement.

        As ``enqueue_in`` for each request, in order. ``key``, if given, is
        called with each request and gives its key, or None for none; ``group``
        is every request's. Every
        request is checked and encoded before anything is written. A key that
        another transaction inserts at the same moment takes one more statement.

        Returns:
            Each request's id, in order: a request whose key is taken (by a
            live request, one held by ``unique_for``, or one earlier in
            ``requests``) gets the holder's.

        Raises:
            As ``enqueue_in``; TypeError if ``key`` is not callable.
        """
        prepared = prepare_enqueue(
            self._codecs, queue, requests, key, delay, priority, unique_for, group
        )
        return self._traced(connection, queue, prepared)

    def _traced(self, connection: psycopg.Connection[Any], queue: str, e: Enqueue) -> list[int]:
        """_enqueue, inside an enqueue span while tickler.otel traces this store."""
        return traced_enqueue(
            self._tracer,
            queue,
            len(e.requests),
            lambda trace: self._enqueue(connection, queue, e, trace),
        )

    def _enqueue(
        self,
        connection: psycopg.Connection[Any],
        queue: str,
        e: Enqueue,
        trace: tuple[str, str] | None = None,
    ) -> list[int]:
        """Insert prepared requests, with ``trace`` (the enqueue span's W3C traceparent and
        tracestate) in each new row; their ids. Times are the server's."""
        import psycopg
        import psycopg.errors
        import psycopg.rows

        if not isinstance(connection, psycopg.Connection):
            raise TypeError("connection must be a psycopg.Connection")
        if not e.requests:
            return []
        if len(e.requests) == 1 and e.keys[0] is None:
            # One request without a key, enqueue_in's usual call: a plain one-row
            # insert, with no array and no key to settle (bench: pg enqueue, 5,000
            # enqueue_in calls; the arrays' statement takes three times as long).
            params: tuple[Any, ...] = (queue, e.state, e.requests[0], e.delay, e.priority, e.group)
            if self.notify:
                params = (*params, self.channel, queue)
            # A cursor of its own reads rows as tuples, whatever the connection's
            # row factory.
            with connection.cursor(row_factory=psycopg.rows.tuple_row) as one:
                try:
                    (row,) = one.execute(self._enqueue_one_statement(), params).fetchall()
                except psycopg.errors.UndefinedTable:
                    raise self._no_tables() from None
                if trace is not None:
                    one.execute(self._set_traces_statement(), (*trace, [row[0]]))
            return [row[0]]
        insert, holders_sql = self._enqueue_statements()
        fixed: dict[str, Any] = {
            "queue": queue,
            "state": e.state,
            "delay": e.delay,
            "priority": e.priority,
            "unique_for": e.unique_for,
            "group": e.group,
            "channel": self.channel,
        }
        # A cursor of its own reads rows as tuples, whatever the connection's
        # row factory.
        with connection.cursor(row_factory=psycopg.rows.tuple_row) as cursor:
            new: list[int] = []

            def write(rows: list[tuple[str | None, bytes]]) -> list[tuple[int, str | None]]:
                keys = [key for key, _ in rows]
                requests = [request for _, request in rows]
                # Without keys, no array of NULLs: unnest() gives NULL for each
                # key of a NULL array.
                params = {**fixed, "keys": keys if any(keys) else None, "requests": requests}
                written = cursor.execute(insert, params, binary=True).fetchall()
                if trace is not None:
                    new.extend(request_id for request_id, _ in written)
                return written

            def holders(keys: list[str]) -> dict[str, int]:
                found = cursor.execute(holders_sql, (queue, keys)).fetchall()
                return dict(found)

            try:
                ids = enqueue_rows(write, holders, e.keys, e.requests, f"queue {queue!r}")
            except psycopg.errors.UndefinedTable:
                raise self._no_tables() from None
            if trace is not None and new:
                cursor.execute(self._set_traces_statement(), (*trace, new))
            return ids

    def _set_traces_statement(self) -> str:
        """(traceparent, tracestate, ids): the trace context of the rows an enqueue_in wrote,
        that of its enqueue span; in this store's schema whatever the caller's search_path."""
        return (
            f'UPDATE "{self.schema}".tickler_requests'  # noqa: S608
            " SET traceparent = %s, tracestate = nullif(%s, '') WHERE id = ANY(%s::int8[])"
        )

    def _no_tables(self) -> StoreError:
        return StoreError(
            f"schema {self.schema!r} has no tickler tables yet: create them with"
            " store.create_schema() (blocking: in a Trio program, through"
            " trio.to_thread.run_sync), or start a service on the store first. The"
            " failed statement aborted the connection's transaction: roll it back"
        )

    def _enqueue_one_statement(self) -> str:
        """The insert of _enqueue_statements for one request without a key: no arrays."""
        if self._enqueue_one_sql is None:
            table = f'"{self.schema}".tickler_requests'
            at = "extract(epoch FROM statement_timestamp())::float8"
            insert = (
                f"INSERT INTO {table}"  # noqa: S608
                " (queue, key, state, request, run_at, enqueued_at, priority, group_name)"
                f" VALUES (%s, NULL, %s, %s, {at} + %s::float8, {at}, %s::int4, %s::text)"
                " RETURNING id"
            )
            if self.notify:
                # The channel and queue are parameters' values, never SQL.
                insert = f"WITH inserted AS ({insert}) SELECT id, pg_notify(%s, %s) FROM inserted"  # noqa: S608
            self._enqueue_one_sql = insert
        return self._enqueue_one_sql

    def _enqueue_statements(self) -> tuple[str, str]:
        """enqueue_in's statements, in this store's schema whatever the caller's search_path.

        The insert writes every request in one statement, their keys and
        requests as arrays (each a parameter, whatever their number, so one
        prepared statement), leaving out each whose key is taken: held by a
        row whose unique_until has not come, or live (the conflict with
        tickler_live_keys). It sends the NOTIFY itself when it inserts a row,
        and the notification goes out at the caller's commit. Its times are
        the server's, as the claim's are, so that a caller's clock cannot hold
        a request back or start it early: the rows are enqueued at the
        statement's time, and due ``delay`` later. The second statement finds
        the holders of the keys the insert left out.
        """
        if self._enqueue_sql is None:
            table = f'"{self.schema}".tickler_requests'
            insert = (
                f"INSERT INTO {table}"  # noqa: S608
                " (queue, key, state, request, run_at, enqueued_at, priority, unique_until,"
                " group_name)"
                " SELECT %(queue)s, u.key, %(state)s, u.request, c.now + %(delay)s::float8,"
                " c.now, %(priority)s::int4,"
                " CASE WHEN u.key IS NULL THEN NULL ELSE c.now + %(unique_for)s::float8 END,"
                " %(group)s::text"
                " FROM unnest(%(requests)b::bytea[], %(keys)b::text[]) WITH ORDINALITY"
                " AS u(request, key, ord),"
                " (SELECT extract(epoch FROM statement_timestamp())::float8 AS now) AS c"
                " WHERE u.key IS NULL OR NOT EXISTS ("
                f" SELECT 1 FROM {table} AS h WHERE h.queue = %(queue)s AND h.key = u.key"
                " AND h.key IS NOT NULL AND h.unique_until > c.now)"
                " ORDER BY u.ord"
                f" ON CONFLICT (queue, key) WHERE key IS NOT NULL AND {_LIVE_STATE}"
                " DO NOTHING RETURNING id, key"
            )
            if self.notify:
                # The channel and queue are parameters' values, never SQL.
                insert = (
                    f"WITH inserted AS ({insert}),"  # noqa: S608
                    " notified AS (SELECT pg_notify(%(channel)s, %(queue)s)"
                    " FROM (SELECT FROM inserted LIMIT 1) AS one)"
                    " SELECT id, key FROM inserted, notified"
                )
            holders = (
                f"SELECT DISTINCT ON (key) key, id FROM {table}"  # noqa: S608
                " WHERE queue = %s AND key = ANY(%s::text[]) AND key IS NOT NULL"
                f" AND ({_LIVE_STATE}"
                " OR unique_until > extract(epoch FROM statement_timestamp())::float8)"
                f" ORDER BY key, {_LIVE_STATE} DESC, id DESC"
            )
            self._enqueue_sql = (insert, holders)
        return self._enqueue_sql

    def use_codec(self, queue: str, codec: Codec) -> None:
        """Encode what ``enqueue_in`` writes to ``queue`` with ``codec`` (its service's)."""
        self._codecs[queue] = codec

    def listener(self, queue: str) -> Listener | None:
        """A LISTEN on this schema's channel for ``queue``, or None with notify=False."""
        if not self.notify:
            return None
        return Listener(
            functools.partial(_open_connection, self.dsn), self.channel, queue, self.poll_interval
        )

    @property
    def channel(self) -> str:
        """The NOTIFY channel of this schema."""
        return f"tickler_{self.schema}"


class PostgresSession:
    """One service's connection to the server, and PostgreSQL's dialect of _sql.run_batch.

    Used by one thread at a time.
    """

    statements = _STATEMENTS
    reads_after_commit = True  # a pipeline's answers stay with their cursors
    # Replicas commit concurrently, so a row can become final with a time
    # earlier than a look that did not see it yet: reach back further (the
    # sweep every 30 looks catches a commit slower than this).
    finals_overlap = 10.0

    def __init__(
        self, store: PostgresStore, *, admin: bool = False, read_only: bool = False
    ) -> None:
        """A service's session; with ``admin``, the admin's: its one connection, and no
        liveness connection (it runs no batch); ``read_only``: an admin's that writes
        nothing (see _check_schema_read_only)."""
        self.store = store
        self.read_only = read_only
        self.limits_written: dict[str, str] = {}
        self.limited_memo: dict[str, LimitedMemo] = {}
        self.db = self._open()
        self._pipeline: psycopg.Pipeline | None = None
        self._lease_ms: int | None = None  # a batch's lease, while it runs (see begin())
        self.liveness = Liveness(self._open_liveness, store.schema)
        if admin:
            return
        try:
            self.liveness.open()
        except BaseException:
            self.db.close()
            raise

    def _open_liveness(self) -> psycopg.Connection[Any]:
        """The connection that holds the liveness lock, and does nothing else."""
        import psycopg

        try:
            return _open_connection(self.store.dsn, "tickler liveness")
        except psycopg.Error as exc:
            raise StoreError(f"cannot connect to PostgreSQL: {exc}") from None

    def _open(self) -> psycopg.Connection[Any]:
        import psycopg

        store = self.store
        try:
            db = _open_connection(store.dsn)
        except psycopg.Error as exc:
            raise StoreError(f"cannot connect to PostgreSQL: {exc}") from None
        try:
            if self.read_only:
                _check_schema_read_only(db, store.schema)
            else:
                _check_schema(db, store.schema)
        except BaseException:
            db.close()
            raise
        return db

    # -- the Session

    def run(
        self, queue: str, owner: str, lease: float, retention: float, batch: Batch
    ) -> BatchResult:
        """_sql.run_batch in psycopg's pipeline mode.

        A statement whose answer the batch does not read (BEGIN, the lease
        renewal, the end of cancelled orphans, the NOTIFY) waits to go out
        with the next one whose answer it reads: fewer round trips, each of
        which costs a wait for the GIL as well as the network.
        """
        self._reconnect_if_broken()
        import psycopg

        try:
            lost = self.liveness.hold(owner, batch.renew)
        except psycopg.Error as exc:
            raise StoreError(f"the liveness lock could not be held: {exc}") from None
        if lost:
            batch = attrs.evolve(batch, claim=0, renew=False)
        try:
            with self.db.pipeline() as pipeline:
                self._pipeline = pipeline
                self._lease_ms = min(max(math.ceil(lease * 1000), 1), 2**31 - 1)
                try:
                    result = run_batch(self, queue, owner, lease, retention, batch)
                    result.lost = lost
                    return result
                finally:
                    self._pipeline, self._lease_ms = None, None
        except BaseException:
            # The session's state after an error in pipeline mode is not
            # certain (the transaction, the prepared statements psycopg
            # believes the server holds): close it, which rolls the batch
            # back, and the next batch connects again.
            self._reset("a failed batch")
            raise

    # psycopg learns that the server ended a session only when a statement
    # fails: these calls then connect again and try once more. (A batch
    # needs no such care: the loop retries it, and begin() reconnects.)
    # Any other error is rolled back (see rollback()), so that it cannot
    # fail the calls and batches after it.

    def lookup(self, queue: str, id_or_key: object) -> Row | None:
        return self._twice(lookup, queue, id_or_key)  # type: ignore[no-any-return]

    def cancel(self, queue: str, id_or_key: object) -> tuple[bool, int | None]:
        return self._twice(cancel, queue, id_or_key)  # type: ignore[no-any-return]

    def statistics(self, queue: str) -> dict[str, int]:
        return self._twice(counts, queue)  # type: ignore[no-any-return]

    def close(self) -> None:
        self.liveness.close()
        self.db.close()

    # -- the admin's words (see _admin.AdminDialect)

    mark = "%s"
    ready_state = _READY
    skip_locked = " FOR UPDATE SKIP LOCKED"

    def key_taken(self, exc: BaseException) -> bool:
        import psycopg.errors

        return isinstance(exc, psycopg.errors.UniqueViolation)

    def deadlocked(self, exc: BaseException) -> bool:
        import psycopg.errors

        return isinstance(exc, psycopg.errors.DeadlockDetected)

    def estimate(self, sql: str, params: Sequence[Any]) -> int | None:
        """The planner's estimate of the query's rows, from the table's statistics (kept
        fresh by autovacuum's analyze: see the table's settings)."""
        row = self.db.execute(f"EXPLAIN (FORMAT JSON) {sql}", params).fetchone()
        try:
            return int(row[0][0]["Plan"]["Plan Rows"])  # type: ignore[index]
        except (TypeError, KeyError, IndexError, ValueError):
            return None

    def run_admin(self, call: Callable[..., _T], *args: Any) -> _T:
        return self._twice(call, *args)  # type: ignore[no-any-return]

    def live_owners(self) -> list[tuple[str, str, int, float]]:
        """The recorded owners whose liveness lock a session holds (see LIVE_OWNERS)."""
        rows = self.db.execute(LIVE_OWNERS).fetchall()
        return [(str(o), str(h), int(p), float(t)) for o, h, p, t in rows]

    # -- the Dialect

    def execute(self, sql: str, params: Any = ()) -> Any:
        return self.db.execute(sql, params)

    def begin(self) -> None:
        """BEGIN; in a batch, then the lock that names its lease (see _pg_live.BATCH_LOCK):
        another replica ends this session if it waits on this process, in this
        transaction, for longer than the lease."""
        self._reconnect_if_broken()  # the server went away, and the loop retries
        self._limits_key = None
        self.db.execute("BEGIN")
        if self._lease_ms is not None:
            # Sent with the next statement whose answer is read (serves: pg drain).
            self.db.execute(_BATCH_LOCK, (self._lease_ms,))

    def commit(self) -> None:
        self.db.execute("COMMIT")
        if self._pipeline is not None:
            self._pipeline.sync()  # the COMMIT's answer, and its error, before run returns

    def rollback(self) -> None:
        """Roll back after an error; out of a batch, close the session if that fails.

        In a batch (in pipeline mode), run() closes the session instead.
        psycopg's rollback() also forgets the statements it prepared, on
        both sides, which an error may have left out of step.
        """
        import psycopg

        if self._pipeline is not None:
            return
        db = self.db
        if db.closed or db.broken:
            return
        try:
            db.rollback()
            if db.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
                return
        except Exception:  # noqa: S110 (the session is closed below)
            pass
        self._reset("a failed rollback")

    def now(self) -> tuple[float, float]:
        """The server's clock: one clock for every replica's leases and times.

        The shift from this process's clock to the server's is measured from
        this process's time before the question, so it is never less than the
        true one: a request enqueued here before the batch is due in the
        batch's claim, and a delay never ends early.
        """
        asked_at = time.time()
        key, self._limits_key = self._limits_key, None
        if key is None:
            row = self.db.execute(_NOW).fetchone()
        else:
            row = self.db.execute(_LOCKED_NOW, (key,)).fetchone()
        assert row is not None
        now = float(row[0])
        return now, now - asked_at

    def insert_rows(self, queue: str, entries: Sequence[Insert], now: float) -> Iterable[int]:
        """One INSERT of many rows; their ids read back, since other sessions draw from the
        same sequence."""
        # Only placeholders are formatted into the statement.
        marks = ",".join(["(%s, NULL, %s, %s, %s, %s, %s, NULL, %s)"] * len(entries))
        params = [
            p
            for e in entries
            for p in (queue, e.state, e.request, e.run_at, now, e.priority, e.group)
        ]
        rows = self.db.execute(f"{INSERT_COLUMNS} VALUES {marks} RETURNING id", params).fetchall()
        # One statement allocates ids in the order of its rows.
        return sorted(request_id for (request_id,) in rows)

    def write_outcomes(
        self, owner: str, outcomes: Sequence[Outcome], now: float
    ) -> Callable[[], list[str | None]]:
        """One UPDATE per kind: its values as arrays, one per column, joined by unnest().

        Their answers are read once the batch has committed: the statements after them go
        out in the same round trip (serves: pg drain, grouped, whose claim reads next).
        """
        by_kind: dict[OutcomeKind, list[Outcome]] = {}
        for outcome in outcomes:
            by_kind.setdefault(outcome.kind, []).append(outcome)
        cursors = []
        if self._lease_ms is None and not _COUNTED_KINDS.isdisjoint(by_kind):
            # Out of a batch (whose first statement says it): the row-level trigger
            # passes over the rows these statements count themselves.
            self.db.execute("SELECT set_config(%s, 'on', TRUE)", (COUNTED_HERE,))
        for kind, some in by_kind.items():
            # serves: pg drain: each outcome's values by one C call, then a column each.
            rows = map(OUTCOME_VALUES[kind], some)
            arrays = [list(column) for column in zip(*rows, strict=True)]
            arrays.append([now] * len(some))
            # The owner twice where the statement counts what it ends (see _COUNT_ENDED).
            owners = [owner, owner] if kind in _COUNTED_KINDS else [owner]
            cursors.append(self.db.execute(_outcome_sql(kind), [*arrays, *owners]))

        def read() -> list[str | None]:
            applied: dict[int, str] = {}
            for cursor in cursors:
                applied.update(cursor.fetchall())
            return [applied.get(outcome.id) for outcome in outcomes]

        return read

    def mark_started(self, owner: str, ids: Sequence[int], now: float) -> None:
        self.db.execute(_STARTED, (now, list(ids), owner))

    def claim(
        self, queue: str, owner: str, now: float, lease_until: float, limit: int
    ) -> Callable[[], list[Claimed]]:
        params = {
            "owner": owner,
            "lease_until": lease_until,
            "now": now,
            "queue": queue,
            "limit": limit,
        }
        return self.db.execute(_CLAIM, params).fetchall

    def due_and_live(self, queue: str) -> Callable[[], tuple[float | None, int, bool]]:
        cursor = self.db.execute(_DUE_AND_LIVE, {"queue": queue})

        def read() -> tuple[float | None, int, bool]:
            due, running, paused = cursor.fetchone()  # type: ignore[misc]
            return due, int(due is not None or bool(running)), bool(paused)

        return read

    def finals(self, ids: Sequence[int]) -> list[Row]:
        return [Row(*row) for row in self.db.execute(_FINALS, (list(ids),))]

    def notify(self, queue: str) -> None:
        """Other replicas wake and claim."""
        if self.store.notify:
            self.db.execute("SELECT pg_notify(%s, %s)", (self.store.channel, queue))

    def after_error_in_transaction(self) -> None:
        """Take the pipeline out of its aborted state: the savepoint's rollback goes next.

        The transaction stays open (failed, until rolled back to a
        savepoint); what the pipeline skipped was only what followed the
        error, whose errors are reported here and passed over.
        """
        import psycopg

        if self._pipeline is not None:
            try:
                self._pipeline.sync()
            except psycopg.Error:
                if self.db.closed or self.db.broken:
                    raise

    def mark_dead(self, queue: str, owner: str, now: float, limit: int) -> None:
        self.db.execute(_MARK_DEAD, (now, queue, owner, limit))

    def listed(self, values: Sequence[Any]) -> list[Any]:
        return list(values)

    # The advisory lock lock_limited() asked for, which the batch's now() takes.
    _limits_key: str | None = None

    def lock_limited(self, queue: str) -> None:
        """A transaction's advisory lock on the schema and queue, which every replica's
        limited claim of the queue takes first in its batch. A claim without limits takes
        no such lock. It is taken by the statement that reads the batch's clock, next
        (serves: pg drain, grouped: one statement less in each of its batches)."""
        self._limits_key = f"tickler:{self.store.schema}:limits:{queue}"

    def ready_chunk(self, queue: str, now: float, size: int) -> Callable[[], list[tuple[Any, ...]]]:
        params = {"queue": queue, "now": now, "limit": size}
        return self.db.execute(_READY_CHUNK, params).fetchall

    def claim_picked(
        self,
        queue: str,
        owner: str,
        lease_until: float,
        now: float,
        picked: Sequence[tuple[int, str | None]],
        rated: Sequence[str],
    ) -> Callable[[], list[Claimed]]:
        params = {
            "queue": queue,
            "owner": owner,
            "lease_until": lease_until,
            "now": now,
            "ids": [request_id for request_id, _ in picked],
            "rated": list(rated),
        }
        return self.db.execute(_CLAIM_PICKED, params).fetchall

    # serves: pg drain, grouped: a limited claim group by group in one statement, which
    # goes out with the COMMIT (see _CLAIM_BY_GROUPS).
    def claim_by_groups(
        self,
        queue: str,
        owner: str,
        lease_until: float,
        now: float,
        limit: int,
        limits: Mapping[str, tuple[int | None, int | None, float]],
        cap: int,
    ) -> Callable[[], tuple[list[Claimed], int, list[str], int, tuple[float | None, int, bool]]]:
        named = [(group, setting) for group, setting in limits.items() if group != "*"]
        default = limits.get("*")
        params = {
            "queue": queue,
            "owner": owner,
            "lease_until": lease_until,
            "now": now,
            "limit": limit,
            "cap": cap,
            "names": [group for group, _ in named],
            "concurrencies": [c for _, (c, _, _) in named],
            "rates": [r for _, (_, r, _) in named],
            "pers": [per for _, (_, _, per) in named],
            "default": default is not None,
            "concurrency": None if default is None else default[0],
            "rate": None if default is None else default[1],
            "per": None if default is None else default[2],
        }
        cursor = self.db.execute(_CLAIM_BY_GROUPS, params)

        def read() -> tuple[list[Claimed], int, list[str], int, tuple[float | None, int, bool]]:
            rows: list[Claimed] = []
            held, blocked, groups, due = 0, [], 0, (None, 0, False)
            for row in cursor.fetchall():
                if row[0] is None:
                    held, blocked, groups = row[8], row[9], row[10]
                    due = (row[11], int(bool(row[12])), bool(row[13]))
                else:
                    rows.append(row[:8])
            return rows, int(held), list(blocked), int(groups), due

        return read

    def group_candidates(
        self, queue: str, now: float, rooms: Sequence[tuple[str, int]], default_room: int
    ) -> Callable[[], list[tuple[Any, ...]]]:
        params = {
            "queue": queue,
            "now": now,
            "groups": [group for group, _ in rooms],
            "rooms": [room for _, room in rooms],
            "default_room": default_room,
        }
        return self.db.execute(_GROUP_CANDIDATES, params).fetchall

    # -- connection handling

    def _twice(self, call: Callable[..., Any], *args: Any) -> Any:
        import psycopg

        self._reconnect_if_broken()
        try:
            return call(self, *args)
        except psycopg.OperationalError:
            lost = self.db.closed or self.db.broken
            self.rollback()
            if not lost:
                raise
        except BaseException:
            self.rollback()
            raise
        self._reconnect_if_broken()
        return call(self, *args)

    def _reset(self, after: str) -> None:
        """Close the session an error left in doubt; the next call connects again."""
        db = self.db
        if db.closed:
            return
        if not db.broken:  # (else the session was lost, not closed here)
            self._reset_after = after
        with contextlib.suppress(Exception):  # closed or not, it is not used again
            db.close()

    # Why this connection closed its last session itself, until it connects again.
    _reset_after: str | None = None

    def _reconnect_if_broken(self) -> None:
        if self.db.closed or self.db.broken:
            self.db = self._open()
            if self._reset_after is not None:
                logger.warning(
                    "%r: connected to PostgreSQL again, the last session having been closed"
                    " after %s",
                    self.store,
                    self._reset_after,
                )
                self._reset_after = None
            else:
                logger.warning(
                    "%r: connected to PostgreSQL again, the last session having been lost",
                    self.store,
                )


def _check_schema(db: psycopg.Connection[Any], schema: str) -> None:
    """Create the schema and tickler's tables in it, or check the ones it holds."""
    with db.transaction():
        # One replica creates the schema; the others wait for it here.
        db.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"tickler:{schema}",))
        db.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
        tables = {
            row[0]
            for row in db.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
                (schema,),
            )
        }
        if "tickler_schema" not in tables:
            if tables:
                raise StoreError(
                    f"schema {schema!r} holds tables that are not tickler's;"
                    " give tickler a schema of its own"
                )
            db.execute(f'SET LOCAL search_path TO "{schema}"')
            for statement in _statements(_SCHEMA):
                db.execute(statement)
            db.execute("INSERT INTO tickler_schema VALUES (%s)", (SCHEMA_VERSION,))
        else:
            _migrate(db, schema)
    db.execute(f'SET search_path TO "{schema}"')
    row = db.execute("SELECT version FROM tickler_schema").fetchone()
    if row is None or row[0] != SCHEMA_VERSION:
        raise StoreError(
            f"schema {schema!r} has tickler schema version {row and row[0]}; this tickler"
            f" reads version {SCHEMA_VERSION}"
        )


def _check_schema_read_only(db: psycopg.Connection[Any], schema: str) -> None:
    """Set the session read-only, in ``schema``, and check its tickler schema: nothing is
    created or migrated, so a role with USAGE on the schema and SELECT on its tables is
    enough (as for ``inspect``).

    Raises:
        StoreError: the schema holds no tickler tables, or a schema of another version.
    """
    import psycopg
    import psycopg.sql

    db.execute("SET default_transaction_read_only = on")
    db.execute(psycopg.sql.SQL("SET search_path TO {}").format(psycopg.sql.Identifier(schema)))
    try:
        row = db.execute("SELECT version FROM tickler_schema").fetchone()
    except psycopg.errors.UndefinedTable:
        raise StoreError(
            f"schema {schema!r} has no tickler tables yet, and a read-only admin creates"
            " none: start a service on it, or call store.create_schema()"
        ) from None
    except psycopg.Error as exc:
        raise StoreError(f"schema {schema!r} cannot be read: {exc}".strip()) from None
    if row is None or row[0] != SCHEMA_VERSION:
        raise StoreError(
            f"schema {schema!r} has tickler schema version {row and row[0]}; a read-only admin"
            f" reads version {SCHEMA_VERSION} and migrates nothing: start a service of this"
            " tickler on it, or call store.create_schema(), to bring it up to date"
        )


def _statements(script: str) -> list[str]:
    """The statements of a script, split at its semicolons but those of a $$-quoted body."""
    found = [""]
    for i, part in enumerate(script.split("$$")):
        if i % 2:
            found[-1] += f"$${part}$$"
        else:
            first, *rest = part.split(";")
            found[-1] += first
            found += rest
    return [statement for statement in found if statement.strip()]


def _migrate(db: psycopg.Connection[Any], schema: str) -> None:
    """Bring an older schema to SCHEMA_VERSION, one version at a time, in the caller's
    transaction (which holds the schema's advisory lock)."""
    row = db.execute(f'SELECT version FROM "{schema}".tickler_schema').fetchone()  # noqa: S608
    if row is None or row[0] not in _MIGRATIONS:
        return  # current, or a version _check_schema refuses
    version = row[0]
    db.execute(f'SET LOCAL search_path TO "{schema}"')
    while version in _MIGRATIONS:
        for statement in _statements(_MIGRATIONS[version]):
            db.execute(statement)
        version += 1
    db.execute("UPDATE tickler_schema SET version = %s", (version,))


_FAILURES = (
    "SELECT id, attempts, error_type, error_message FROM tickler_requests"
    " WHERE queue = %s AND state = 'failed' ORDER BY finished_at DESC LIMIT %s"
)


def inspect(dsn: str, schema: str, latest: int) -> dict[str, QueueReport]:
    """Each queue of the schema: its counts, ``latest`` failures and paused flag, in a
    read-only session.

    Raises:
        ValueError: the server cannot be reached (the message may quote the DSN,
            password and all), or the schema is not a tickler store of this version.
    """
    import psycopg
    import psycopg.sql

    try:
        db = psycopg.connect(dsn, autocommit=True, connect_timeout=10)
    except (psycopg.Error, ValueError) as exc:
        raise ValueError(f"cannot connect: {exc}".strip()) from None
    try:
        db.execute("SET default_transaction_read_only = on")
        db.execute(psycopg.sql.SQL("SET search_path TO {}").format(psycopg.sql.Identifier(schema)))
        try:
            version = db.execute("SELECT version FROM tickler_schema").fetchone()
        except psycopg.Error:
            raise ValueError(f"schema {schema!r}: not a tickler store") from None
        # An older version reads the same, but for the paused flags, which it has none of.
        if version is None or (version[0] != SCHEMA_VERSION and version[0] not in _MIGRATIONS):
            raise ValueError(f"schema {schema!r}: tickler schema version unknown")
        return report(
            lambda sql, params: db.execute(sql, params).fetchall(),
            _FAILURES,
            latest,
            paused=version[0] >= 2,
            groups=_STATEMENTS.busiest_groups if version[0] >= 3 else None,
            rescues=version[0] >= 4,
        )
    finally:
        db.close()


def set_paused(dsn: str, schema: str, queue: str, paused: bool) -> list[str]:
    """Pause a queue of the schema, or resume it, for every replica: a paused queue's
    services claim nothing, while what they run goes on. Sends the NOTIFY that wakes
    the replicas listening. An older schema is brought up to date. Returns the queues
    the store knew before, by name (as ``Admin.queues()``).

    Raises:
        ValueError: the server cannot be reached (the message may quote the DSN,
            password and all), the schema is not a tickler store of a version this
            knows, or ``queue`` is not a queue name.
    """
    import psycopg

    check_queue_name(queue, "queue")
    if not isinstance(schema, str) or not _IDENTIFIER.match(schema):
        raise ValueError(f"schema {schema!r}: not a tickler schema name")
    try:
        db = psycopg.connect(dsn, autocommit=True, connect_timeout=10)
    except (psycopg.Error, ValueError) as exc:
        raise ValueError(f"cannot connect: {exc}".strip()) from None
    try:
        found = db.execute(
            "SELECT 1 FROM information_schema.tables"
            " WHERE table_schema = %s AND table_name = 'tickler_schema'",
            (schema,),
        ).fetchone()
        if found is None:
            raise ValueError(f"schema {schema!r}: not a tickler store")
        try:
            _check_schema(db, schema)
        except StoreError as exc:
            raise ValueError(str(exc)) from None
        with db.transaction():
            known = sorted(str(name) for (name,) in db.execute(KNOWN_QUEUES_BY_STATE))
            db.execute(_SET_PAUSED, (queue, bool(paused)))
            db.execute("SELECT pg_notify(%s, %s)", (f"tickler_{schema}", queue))
    finally:
        db.close()
    return known
