"""python -m tickler inspect sqlite:///path/to/file.db: each queue's counts and latest failures."""

from __future__ import annotations

import argparse
import sqlite3
import sys
from collections.abc import Sequence
from pathlib import Path

from ._sqlite import FINAL, LIVE, SCHEMA_VERSION

_PREFIX = "sqlite:///"
_LATEST_FAILURES = 5


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
        if version is None or version[0] != SCHEMA_VERSION:
            raise ValueError(f"{path}: tickler schema version {version and version[0]} unknown")
        counts: dict[str, dict[str, int]] = {}
        for queue, state, count in db.execute(
            "SELECT queue, state, count(*) FROM tickler_requests GROUP BY queue, state"
        ):
            counts.setdefault(queue, dict.fromkeys((*LIVE, *FINAL), 0))[state] = count
        lines = []
        if not counts:
            lines.append("no requests")
        for queue in sorted(counts):
            states = counts[queue]
            lines.append(f"queue {queue!r}: " + ", ".join(f"{n} {s}" for s, n in states.items()))
            failures = db.execute(
                "SELECT id, attempts, error_type, error_message FROM tickler_requests"
                " WHERE queue = ? AND state = 'failed' ORDER BY finished_at DESC LIMIT ?",
                (queue, _LATEST_FAILURES),
            ).fetchall()
            for request_id, attempts, error_type, message in failures:
                lines.append(
                    f"  failed #{request_id} after {attempts} attempt(s): {error_type}: {message}"
                )
        return "\n".join(lines)
    finally:
        db.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tickler")
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="print a store's queues, counts and failures")
    inspect.add_argument("url", help="sqlite:///path/to/file.db")
    args = parser.parse_args(argv)
    url: str = args.url
    if not url.startswith(_PREFIX):
        print(f"python -m tickler: {url!r} is not a sqlite:///path URL", file=sys.stderr)
        return 2
    try:
        print(inspect_sqlite(Path(url[len(_PREFIX) :])))
    except ValueError as exc:
        print(f"python -m tickler: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
