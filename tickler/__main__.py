"""python -m tickler inspect URL: each queue's counts by status and latest failures.

URL is sqlite:///relative.db, sqlite:////absolute.db, or a postgresql:// DSN
(with --schema, "tickler" by default).
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._postgres import SCHEMA_VERSION as postgres_version
from ._postgres import _psycopg_style
from ._sqlite import _MIGRATIONS, FINAL, LIVE, SCHEMA_VERSION

_PREFIX = "sqlite:///"
_LATEST_FAILURES = 5


_COUNTS = "SELECT queue, state, count(*) FROM tickler_requests GROUP BY queue, state"
_FAILURES = (
    "SELECT id, attempts, error_type, error_message FROM tickler_requests"
    " WHERE queue = ? AND state = 'failed' ORDER BY finished_at DESC LIMIT ?"
)


def _report(execute: Any) -> str:
    """The report, from a function that runs one statement with ? placeholders."""
    counts: dict[str, dict[str, int]] = {}
    for queue, state, count in execute(_COUNTS, ()):
        counts.setdefault(queue, dict.fromkeys((*LIVE, *FINAL), 0))[state] = count
    lines = []
    if not counts:
        lines.append("no requests")
    for queue in sorted(counts):
        states = counts[queue]
        lines.append(f"queue {queue!r}: " + ", ".join(f"{n} {s}" for s, n in states.items()))
        for request_id, attempts, error_type, message in execute(
            _FAILURES, (queue, _LATEST_FAILURES)
        ):
            lines.append(
                f"  failed #{request_id} after {attempts} attempt(s): {error_type}: {message}"
            )
    return "\n".join(lines)


def inspect_postgres(dsn: str, schema: str) -> str:
    """The report for one schema; raises ValueError if it cannot be read."""
    import psycopg
    import psycopg.sql

    try:
        db = psycopg.connect(dsn, autocommit=True, connect_timeout=10)
    except psycopg.Error as exc:
        raise ValueError(f"cannot connect: {exc}".strip()) from None
    try:
        db.execute("SET default_transaction_read_only = on")
        db.execute(psycopg.sql.SQL("SET search_path TO {}").format(psycopg.sql.Identifier(schema)))
        try:
            version = db.execute("SELECT version FROM tickler_schema").fetchone()
        except psycopg.Error:
            raise ValueError(f"schema {schema!r}: not a tickler store") from None
        if version is None or version[0] != postgres_version:
            raise ValueError(f"schema {schema!r}: tickler schema version unknown")
        return _report(lambda sql, params: db.execute(_psycopg_style(sql), params).fetchall())
    finally:
        db.close()


def inspect_sqlite(path: Path) -> str:
    """The report for one file; raises ValueError for a missing or foreign file."""
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        raise ValueError(f"{path}: cannot open it ({exc})") from None
    try:
        try:
            version = db.execute("SELECT version FROM tickler_schema").fetchone()
        except sqlite3.DatabaseError:
            raise ValueError(f"{path}: not a tickler store") from None
        # An older version reads the same (a migration changes only indexes).
        if version is None or (version[0] != SCHEMA_VERSION and version[0] not in _MIGRATIONS):
            raise ValueError(f"{path}: tickler schema version {version and version[0]} unknown")
        return _report(lambda sql, params: db.execute(sql, params).fetchall())
    finally:
        db.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tickler")
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="print a store's queues, counts and failures")
    inspect.add_argument("url", help="sqlite:///path/to/file.db or a postgresql:// DSN")
    inspect.add_argument("--schema", default="tickler", help="with PostgreSQL (default tickler)")
    args = parser.parse_args(argv)
    try:
        print(inspect_url(args.url, args.schema))
    except ValueError as exc:
        print(f"python -m tickler: {exc}", file=sys.stderr)
        return 2
    return 0


def inspect_url(url: str, schema: str) -> str:
    if url.startswith(("postgresql://", "postgres://")):
        return inspect_postgres(url, schema)
    if url.startswith(_PREFIX):
        return inspect_sqlite(Path(url[len(_PREFIX) :]))
    raise ValueError(f"{url!r} is neither a sqlite:/// URL nor a postgresql:// DSN")


if __name__ == "__main__":
    sys.exit(main())
