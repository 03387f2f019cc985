"""PostgreSQL's liveness locks: a session-level advisory lock per owner, on a connection of
its own, which the server releases when the session ends.

A service's session takes the lock of its owner id (``hashtextextended('tickler:owner:'
|| owner, 0)``) on a connection that does nothing else, and records the owner in
``tickler_owners`` with the time it took the lock, and its process's host and pid (the
admin lists the owners whose lock is held: see LIVE_OWNERS). The server ends a dead
client's session, and the lock with it: another replica's batch then finds the lock free
(pg_try_advisory_xact_lock, held until its transaction ends) and rescues the owner's
rows at once. An owner whose record is older than the server's start has not taken its
lock again since a restart: it may be alive and reconnecting, and only its lease
rescues its rows.

Each look pings the connection (the ping deletes the records of dead owners that run
nothing). If the connection was lost and the server did not restart, the lock was
lost while this process lives (its backend was terminated, say): the session says so,
and its service takes a new owner id. If the server restarted, the lock is taken again
for the same owner.

A process stopped (or cut off) in the middle of a batch keeps its lock, and its batch's
transaction keeps the row locks it took, which every claim skips: no lease could rescue
those rows, and the server never ends such a session by itself (mid-pipeline, it is not
idle in its transaction). So each batch's transaction takes, first, a shared advisory
lock that names its lease (BATCH_LOCK, the lease in milliseconds as the second key);
the ping of every replica ends the session of a batch that has waited on its client
while its transaction outlived that lease. By then the stuck owner's leases have lapsed
(its last renewal committed before that transaction began), so ending it takes nothing
that a claim could not take; its late results are fenced like any other.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._exceptions import StoreError
from ._admin import this_process

logger = logging.getLogger("tickler")

if TYPE_CHECKING:
    import psycopg

# The advisory lock key of an owner, as SQL of the owner's column or parameter.
LOCK_KEY = "hashtextextended('tickler:owner:' || {owner}, 0)"

# The first key of the shared advisory lock each batch's transaction takes first
# (pg_advisory_xact_lock_shared(BATCH_LOCK, lease in ms)), b"tick" as an int4.
BATCH_LOCK = 0x7469636B

# A session's batch whose transaction outlived its lease while it waited on its client:
# the pids of the sessions ended. Only where this role may end them (its own role's, or
# any with pg_signal_backend; a superuser's only by a superuser).
_END_STUCK = f"""
SELECT l.pid, pg_terminate_backend(l.pid) AS ended
FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.classid = {BATCH_LOCK} AND l.objsubid = 2
    AND l.granted AND l.pid <> pg_backend_pid()
    AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
    AND a.wait_event = 'ClientRead'
    AND a.xact_start < clock_timestamp() - l.objid::int8 * interval '1 millisecond'
    AND (pg_has_role(a.usesysid, 'USAGE') OR pg_has_role('pg_signal_backend', 'USAGE'))
    AND (NOT (SELECT rolsuper FROM pg_roles WHERE oid = a.usesysid)
        OR (SELECT rolsuper FROM pg_roles WHERE rolname = current_user))
"""  # noqa: S608 (constants only)

# The recorded owners whose lock the session that took it holds now, read in pg_locks
# (which every role may read) without taking any lock. A bigint advisory lock's key is its
# classid (the high 32 bits) and objid (the low 32), objsubid 1. The holder must be the
# backend recorded with the owner: another replica's look at a dead owner holds its lock
# for an instant too (pg_try_advisory_xact_lock), and must not make it look alive.
LIVE_OWNERS = f"""
SELECT o.owner, o.host, o.pid, o.locked_at FROM tickler_owners AS o
WHERE ({LOCK_KEY.format(owner="o.owner")}, o.backend_pid) IN (
    SELECT (l.classid::int8 << 32) | l.objid::int8, l.pid FROM pg_locks AS l
    WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
        AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()))
"""  # noqa: S608 (constants only)

# How long a session tries to take its lock (a replica's batch holds it for an instant
# while it asks whether the owner is alive).
_TAKE_FOR = 2.0


class Liveness:
    """One session's liveness connection and lock."""

    def __init__(self, connect: Callable[[], psycopg.Connection[Any]], schema: str) -> None:
        self.connect = connect
        self.db: psycopg.Connection[Any] | None = None
        self.owner: str | None = None
        self.started: float | None = None  # the server's start, when the lock was taken
        owners = f'"{schema}".tickler_owners'
        requests = f'"{schema}".tickler_requests'
        # One round trip: try the lock; if taken, record it; and the server's start.
        self.take = (
            f"WITH locked AS (SELECT pg_try_advisory_lock({LOCK_KEY.format(owner='%s')}) AS ok),"  # noqa: S608 (a checked identifier)
            f" recorded AS (INSERT INTO {owners} (owner, locked_at, host, pid, backend_pid)"
            " SELECT %s, extract(epoch FROM clock_timestamp()), %s, %s, pg_backend_pid()"
            " FROM locked WHERE ok"
            " ON CONFLICT (owner) DO UPDATE SET locked_at = excluded.locked_at,"
            " host = excluded.host, pid = excluded.pid, backend_pid = excluded.backend_pid"
            " RETURNING 1)"
            " SELECT ok, extract(epoch FROM pg_postmaster_start_time())::float8,"
            " (SELECT count(*) FROM recorded) FROM locked"
        )
        # The ping: the sessions of stuck batches end (see _END_STUCK), and the records
        # of owners whose lock is free and that run nothing go; the pids ended.
        self.ping = (
            f"WITH stuck AS ({_END_STUCK}),"  # noqa: S608 (a checked identifier)
            f" gone AS (DELETE FROM {owners} AS o WHERE o.owner <> %s"
            f" AND NOT EXISTS (SELECT 1 FROM {requests} AS r"
            " WHERE r.state = 'running' AND r.owner = o.owner)"
            # An owner that has not taken its lock since a restart may be taking it again:
            # its lock is tried once the server has run for an hour.
            " AND CASE WHEN o.locked_at > extract(epoch FROM pg_postmaster_start_time())"
            " OR now() - pg_postmaster_start_time() > interval '1 hour'"
            f" THEN pg_try_advisory_xact_lock({LOCK_KEY.format(owner='o.owner')})"
            " ELSE FALSE END RETURNING 1)"
            " SELECT (SELECT array_agg(pid) FROM stuck WHERE ended), (SELECT count(*) FROM gone)"
        )
        self.unregister = (
            f"DELETE FROM {owners} AS o WHERE o.owner = %s"  # noqa: S608 (a checked identifier)
            f" AND NOT EXISTS (SELECT 1 FROM {requests} AS r"
            " WHERE r.state = 'running' AND r.owner = o.owner)"
        )

    def hold(self, owner: str, check: bool) -> bool:
        """Hold ``owner``'s lock; True if it was lost while this process lives.

        ``check``: ping the connection (a look). Raises StoreError if the server cannot
        be reached: the batch fails, and the next one tries again.
        """
        import psycopg

        if owner != self.owner:
            if self.owner is not None:
                self.release()  # (the old lock with its session)
            fresh = self.db if self.db is not None and not self.db.broken else self.connect()
            self.db = None
            if not self._take(fresh, owner):
                fresh.close()
                return True
            self.db, self.owner = fresh, owner
            return False
        held = self.db
        if held is not None:
            if not check:
                return False
            try:
                row = held.execute(self.ping, (owner,)).fetchone()
            except psycopg.OperationalError:
                if not (held.closed or held.broken):
                    raise
            else:
                if row is not None and row[0]:
                    logger.warning(
                        "ended the PostgreSQL sessions %s: each waited on its client in a"
                        " batch's transaction for longer than its lease (a stuck or cut-off"
                        " process), holding rows no claim could take",
                        ", ".join(map(str, sorted(row[0]))),
                    )
                return False
            self.db = None
            with contextlib.suppress(Exception):
                held.close()
        # The connection was lost: the lock with it.
        db = self.connect()
        if _server_start(db) == self.started or not self._take(db, owner):
            # The server lives on: another replica may have rescued this owner's rows.
            db.close()
            self.owner = None
            return True
        self.db = db
        return False

    def open(self) -> None:
        """Connect ahead of the first batch, which then only takes the lock."""
        if self.db is None:
            self.db = self.connect()

    def _take(self, db: psycopg.Connection[Any], owner: str) -> bool:
        """Take owner's lock on ``db`` and record it; False if another session holds it."""
        give_up = time.monotonic() + _TAKE_FOR
        while True:
            row = db.execute(self.take, (owner, owner, *this_process())).fetchone()
            if row is not None and row[0]:
                self.started = float(row[1])
                return True
            if time.monotonic() > give_up:
                return False
            time.sleep(0.02)

    def release(self) -> None:
        """Give the lock up: the session ends (the owner's record stays until the owner
        runs nothing). The next owner connects again."""
        db, self.db, self.owner = self.db, None, None
        if db is not None:
            with contextlib.suppress(Exception):
                db.close()

    def close(self) -> None:
        """The service's run ended: its record goes if it runs nothing; the lock is given up."""
        db = self.db
        if db is not None and self.owner is not None:
            with contextlib.suppress(Exception):
                db.execute(self.unregister, (self.owner,))
        self.release()


def _server_start(db: psycopg.Connection[Any]) -> float:
    row = db.execute("SELECT extract(epoch FROM pg_postmaster_start_time())::float8").fetchone()
    if row is None:
        raise StoreError("the server gave no start time")
    return float(row[0])
