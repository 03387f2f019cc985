"""Site status objects in SQLite (WAL mode), reached from Trio through a worker thread."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path
from typing import Any

import trio

STEPS = ("metadata", "fs", "db", "bootstrap", "delete")
FLAGS = ("metadata_ready", "fs_ready", "db_ready", "bootstrapped")

SCHEMA = """
CREATE TABLE IF NOT EXISTS sites (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    tagline TEXT NOT NULL,
    domain TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('creating', 'running', 'deleting', 'deleted')),
    metadata_ready INTEGER NOT NULL DEFAULT 0,
    fs_ready INTEGER NOT NULL DEFAULT 0,
    db_ready INTEGER NOT NULL DEFAULT 0,
    bootstrapped INTEGER NOT NULL DEFAULT 0,
    metadata_attempts INTEGER NOT NULL DEFAULT 0,
    fs_attempts INTEGER NOT NULL DEFAULT 0,
    db_attempts INTEGER NOT NULL DEFAULT 0,
    bootstrap_attempts INTEGER NOT NULL DEFAULT 0,
    delete_attempts INTEGER NOT NULL DEFAULT 0
);
-- A domain is taken while a site holding it is not deleted.
CREATE UNIQUE INDEX IF NOT EXISTS live_domain ON sites (domain) WHERE state != 'deleted';
"""


class DomainTaken(Exception):
    """Another live site already has this domain."""


def as_status(row: sqlite3.Row) -> dict[str, Any]:
    """The JSON status body of a site row."""
    return {
        "id": row["id"],
        "name": row["name"],
        "tagline": row["tagline"],
        "domain": row["domain"],
        "state": row["state"],
        **{flag: bool(row[flag]) for flag in FLAGS},
        "attempts": {step: row[f"{step}_attempts"] for step in STEPS},
    }


class Store:
    """The status table. Every call runs in a worker thread, one at a time."""

    def __init__(self, path: Path) -> None:
        self._connection = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._connection.row_factory = sqlite3.Row
        self._connection.execute("PRAGMA journal_mode=WAL")
        self._connection.executescript(SCHEMA)
        self._lock = threading.Lock()
        self._limiter = trio.CapacityLimiter(1)

    def close(self) -> None:
        self._connection.close()

    async def _run(self, sql: str, params: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        def run() -> list[sqlite3.Row]:
            with self._lock:
                return self._connection.execute(sql, params).fetchall()

        return await trio.to_thread.run_sync(run, limiter=self._limiter)

    async def create(self, name: str, tagline: str, domain: str) -> dict[str, Any]:
        try:
            [row] = await self._run(
                "INSERT INTO sites (name, tagline, domain, state) VALUES (?, ?, ?, 'creating')"
                " RETURNING *",
                (name, tagline, domain),
            )
        except sqlite3.IntegrityError:
            raise DomainTaken(domain) from None
        return as_status(row)

    async def forget(self, site_id: int) -> None:
        """Remove a site that was never accepted (its request was refused)."""
        await self._run("DELETE FROM sites WHERE id = ?", (site_id,))

    async def get(self, site_id: int) -> dict[str, Any] | None:
        rows = await self._run("SELECT * FROM sites WHERE id = ?", (site_id,))
        return as_status(rows[0]) if rows else None

    async def count_attempt(self, site_id: int, step: str) -> None:
        assert step in STEPS
        await self._run(
            f"UPDATE sites SET {step}_attempts = {step}_attempts + 1 WHERE id = ?",  # noqa: S608 - step is one of STEPS
            (site_id,),
        )

    async def set_flag(self, site_id: int, flag: str) -> None:
        """Set a creation flag, only while the site is still being created."""
        assert flag in FLAGS
        await self._run(
            f"UPDATE sites SET {flag} = 1 WHERE id = ? AND state = 'creating'",  # noqa: S608 - flag is one of FLAGS
            (site_id,),
        )

    async def mark_running(self, site_id: int) -> bool:
        rows = await self._run(
            "UPDATE sites SET state = 'running' WHERE id = ? AND state = 'creating'"
            " AND metadata_ready AND fs_ready AND db_ready AND bootstrapped RETURNING id",
            (site_id,),
        )
        return bool(rows)

    async def mark_deleting(self, site_id: int) -> dict[str, Any] | None:
        await self._run(
            "UPDATE sites SET state = 'deleting' WHERE id = ? AND state IN ('creating', 'running')",
            (site_id,),
        )
        return await self.get(site_id)

    async def mark_deleted(self, site_id: int) -> None:
        await self._run(
            "UPDATE sites SET state = 'deleted', metadata_ready = 0, fs_ready = 0,"
            " db_ready = 0, bootstrapped = 0 WHERE id = ? AND state = 'deleting'",
            (site_id,),
        )

    async def unfinished(self) -> list[dict[str, Any]]:
        rows = await self._run(
            "SELECT * FROM sites WHERE state IN ('creating', 'deleting') ORDER BY id"
        )
        return [as_status(row) for row in rows]
