"""What the process tests' worker processes share: tests/limits_worker.py, tests/schedule_worker.py.

Each is run as ``python -m tests.WORKER DB LOG STOP [--schema S] [--lease L]
[--poll-interval P] [--capacity N] [--sleep S]``, and options of its own.
DB is a SQLite file, or a postgresql:// DSN (then --schema names the schema).
It runs the queue "jobs" until the file STOP exists, appending lines to LOG,
which every worker shares. Each line is ``PID KIND ... TIME`` (TIME is
time.time() when it was logged) and reaches the file with one write before
the worker goes on, so a SIGKILL loses none.

Kept apart from tests/store_runs.py, which the tests themselves import: a
worker imports no pytest.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import tickler


class Log:
    """The shared log, opened for appending: one write() per line, flushed at once."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a", buffering=1)  # line-buffered: each line is written whole

    def __call__(self, *fields: Any) -> None:
        self.file.write(" ".join(map(str, (os.getpid(), *fields, repr(time.time())))) + "\n")


def arguments(*, capacity: int, sleep: float) -> argparse.ArgumentParser:
    """The arguments every worker takes, with its defaults for --capacity and --sleep."""
    parser = argparse.ArgumentParser()
    parser.add_argument("db")
    parser.add_argument("log")
    parser.add_argument("stop")
    parser.add_argument("--schema", default="tickler", help="with a postgresql:// DB")
    parser.add_argument("--lease", type=float, default=2.0)
    parser.add_argument("--poll-interval", type=float, default=0.1)
    parser.add_argument("--capacity", type=int, default=capacity)
    parser.add_argument("--sleep", type=float, default=sleep)
    return parser


def open_store(args: argparse.Namespace) -> tickler.SqliteStore | tickler.PostgresStore:
    """The store on DB, with the lease and poll_interval given."""
    options = {"lease": args.lease, "poll_interval": args.poll_interval}
    if args.db.startswith("postgresql://"):
        return tickler.PostgresStore(args.db, schema=args.schema, **options)
    return tickler.SqliteStore(args.db, **options)
