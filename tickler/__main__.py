"""python -m tickler: look at a store, act on its queues and requests, serve its dashboard.

- ``inspect URL``: each queue's counts by status and latest failures,
  whether it is paused, its per-group limits if it has any, and its busiest
  groups (the most running first, then the most waiting), each with its
  live rows by status (those it has).
- ``pause URL QUEUE``: the queue's services, in every process, claim nothing
  more (what they run goes on) until ``resume URL QUEUE``.
- ``cancel URL QUEUE ID_OR_KEY...``: cancel requests (a running one through
  its replica, within one poll_interval); ``retry URL QUEUE ID...``: queue
  failed or cancelled requests again. Both through ``store.admin()``.
- ``migrate URL``: create the store's schema, or bring it up to date.
- ``web URL``: serve the dashboard (tickler.web, the ``web`` extra).

URL is sqlite:///relative.db, sqlite:////absolute.db, or a postgresql:// DSN
(with --schema, "tickler" by default). A password in the URL is never printed:
every message shows it as ***.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio

from ._codec import check_queue_name, encode_key
from ._exceptions import StoreError
from ._stores import postgres, sqlite
from ._stores._sql import QueueReport
from ._urls import _PREFIX, _is_postgres, open_store, redact
from ._values import GroupLimit

__all__ = ["main", "open_store", "redact"]

_LATEST_FAILURES = 5


def _limit(limit: GroupLimit) -> str:
    """One group's limit, as the report shows it."""
    concurrency, rate, per = limit
    parts = []
    if concurrency is not None:
        parts.append(f"concurrency {concurrency}")
    if rate is not None:
        parts.append(f"rate {rate} per {per:g}s")
    return ", ".join(parts) or "no limit"


def _report(queues: dict[str, QueueReport]) -> str:
    """The report: each queue's counts by status, its limits and busiest groups, then its
    latest failures."""
    lines = []
    if not queues:
        lines.append("no requests")
    for queue, found in queues.items():
        counts = ", ".join(f"{n} {state}" for state, n in found.counts.items())
        paused = " (paused)" if found.paused else ""
        lines.append(f"queue {queue!r}{paused}: {counts}")
        if found.limits:
            limits = "; ".join(
                f"{group!r} {_limit(limit)}" for group, limit in sorted(found.limits.items())
            )
            lines.append(f"  limits by group: {limits}")
        if any(found.rescues.values()):
            rescued = ", ".join(f"{n} {reason}" for reason, n in found.rescues.items())
            lines.append(f"  rescued: {rescued}")
        for group, by_state in found.groups:
            shown = ", ".join(f"{n} {state}" for state, n in by_state.items() if n)
            lines.append(f"  group {group!r}: {shown}")
        for request_id, attempts, error_type, message in found.failures:
            lines.append(
                f"  failed #{request_id} after {attempts} attempt(s): {error_type}: {message}"
            )
    return "\n".join(lines)


def inspect_postgres(dsn: str, schema: str) -> str:
    """The report for one schema; raises ValueError if it cannot be read."""
    try:
        return _report(postgres.inspect(dsn, schema, _LATEST_FAILURES))
    except ValueError as exc:
        # libpq quotes a malformed DSN, or a piece of it, in its message.
        raise ValueError(redact(str(exc), [dsn])) from None


def inspect_sqlite(path: Path) -> str:
    """The report for one file; raises ValueError for a missing or foreign file."""
    return _report(sqlite.inspect(path, _LATEST_FAILURES))


def set_paused_url(url: str, schema: str, queue: str, paused: bool) -> tuple[str, str | None]:
    """Pause or resume ``queue`` of the store at ``url``: the line saying what was done,
    and a warning if the store did not know the queue (a misspelt name, say), naming the
    queues it knows.

    Raises ValueError if the store cannot be reached or is not a tickler store.
    """
    if url.startswith(("postgresql://", "postgres://")):
        try:
            known = postgres.set_paused(url, schema, queue, paused)
        except ValueError as exc:
            raise ValueError(redact(str(exc), [url])) from None
        where = f"{redact(url, [url])} (schema {schema!r})"
    elif url.startswith(_PREFIX):
        known = sqlite.set_paused(Path(url[len(_PREFIX) :]), queue, paused)
        where = url
    else:
        raise ValueError(
            f"{redact(url, [url])!r} is neither a sqlite:/// URL nor a postgresql:// DSN"
        )
    done = "paused" if paused else "resumed"
    more = (
        "its services claim nothing until it is resumed" if paused else "its services claim again"
    )
    warning = None
    if queue not in known:
        others = ", ".join(map(repr, known)) if known else "none"
        warning = (
            f"warning: queue {queue!r} has no requests and was never paused or limited"
            f" (a misspelt name?); known queues: {others}"
        )
    return f"{done} queue {queue!r} of {where}: {more}", warning


def _where(url: str, schema: str) -> str:
    """The store as messages name it: its URL, password hidden, and schema."""
    shown = redact(url, [url])
    return f"{shown} (schema {schema!r})" if _is_postgres(url) else shown


def _id_or_key(text: str, keys: bool) -> int | str | tuple[Any, ...]:
    """A command line's request: digits are an id, a JSON array a tuple key, else a str key
    (every one a str key with --keys)."""
    if keys:
        return text
    if text.isascii() and text.isdigit():
        return int(text)
    if text.startswith("["):
        try:
            found = json.loads(text)
        except ValueError:
            return text
        if isinstance(found, list):
            return tuple(found)
    return text


def cancel_url(
    url: str, schema: str, queue: str, targets: Sequence[str], keys: bool
) -> tuple[str, bool]:
    """Cancel each request of ``targets``; the lines saying what was done, and whether
    every one was cancelled (or its cancel asked of its replica).

    Every target is checked before any is cancelled: a bad one raises TypeError or
    ValueError, naming it, and nothing is cancelled."""
    check_queue_name(queue, "queue")
    found = []
    for text in targets:
        target = _id_or_key(text, keys)
        if not isinstance(target, int):
            try:
                encode_key(target)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"ID_OR_KEY {text!r}: {exc}; nothing was cancelled") from None
        found.append((text, target))
    store = open_store(url, schema=schema)

    async def run() -> tuple[list[str], bool]:
        lines, every = [], True
        async with store.admin() as admin:
            for text, target in found:
                shown = f"#{target}" if isinstance(target, int) else f"key {text!r}"
                if not await admin.cancel(queue, target):
                    lines.append(f"not cancelled: {shown} is final, or not a request of {queue!r}")
                    every = False
                    continue
                row = await admin.lookup(queue, target)
                if row is not None and row.state == "running":
                    lines.append(
                        f"asked the replica running {shown} (#{row.id}) to cancel it: it ends"
                        " cancelled within one poll_interval"
                    )
                else:
                    by_key = "" if row is None or isinstance(target, int) else f" (#{row.id})"
                    lines.append(f"cancelled {shown}{by_key}")
        return lines, every

    lines, every = trio.run(run)
    return "\n".join(lines), every


def retry_url(url: str, schema: str, queue: str, ids: Sequence[int]) -> tuple[str, bool]:
    """Queue each failed or cancelled request of ``ids`` again; the lines saying what was
    done, and whether every one was."""
    store = open_store(url, schema=schema)

    async def run() -> tuple[list[str], bool]:
        lines, every = [], True
        async with store.admin() as admin:
            for request_id in ids:
                if await admin.retry(queue, request_id):
                    lines.append(f"queued #{request_id} again: it runs at the next claim")
                else:
                    lines.append(
                        f"not retried: #{request_id} is not a failed or cancelled request of"
                        f" {queue!r}, or a later request holds its key"
                    )
                    every = False
        return lines, every

    lines, every = trio.run(run)
    return "\n".join(lines), every


def migrate_url(url: str, schema: str) -> str:
    """Create the store's schema, or bring it up to date; the line saying so."""
    store = open_store(url, schema=schema, create=True)
    try:
        store.create_schema()
    except StoreError as exc:
        raise ValueError(str(exc)) from None
    version = postgres.SCHEMA_VERSION if _is_postgres(url) else sqlite.SCHEMA_VERSION
    return f"{_where(url, schema)}: tickler schema version {version}"


def _basic_auth(given: str | None) -> tuple[str, str] | None:
    """--basic-auth USER:PASSWORD, else TICKLER_WEB_BASIC_AUTH, else None."""
    text = given if given is not None else os.environ.get("TICKLER_WEB_BASIC_AUTH")
    if text is None:
        return None
    user, colon, password = text.partition(":")
    if not colon or not user or not password:
        raise ValueError("--basic-auth (or TICKLER_WEB_BASIC_AUTH) must be USER:PASSWORD")
    return user, password


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tickler")
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser(
        "inspect",
        help="print a store's queues, counts and failures, which are paused, their limits"
        " and busiest groups",
    )
    inspect.add_argument("url", help="sqlite:///path/to/file.db or a postgresql:// DSN")
    inspect.add_argument("--schema", default="tickler", help="with PostgreSQL (default tickler)")
    for name, says in [
        ("pause", "stop every service of a queue from claiming (what runs goes on)"),
        ("resume", "let a paused queue's services claim again"),
    ]:
        command = commands.add_parser(name, help=says)
        command.add_argument("url", help="sqlite:///path/to/file.db or a postgresql:// DSN")
        command.add_argument("queue", help="the queue's name (its services' name)")
        command.add_argument(
            "--schema", default="tickler", help="with PostgreSQL (default tickler)"
        )
    url_help = "sqlite:///path/to/file.db or a postgresql:// DSN"
    schema_help = "with PostgreSQL (default tickler)"
    cancel = commands.add_parser(
        "cancel",
        help="cancel requests: at once, or through the replica running them",
    )
    cancel.add_argument("url", help=url_help)
    cancel.add_argument("queue", help="the queue's name (its services' name)")
    cancel.add_argument(
        "targets",
        nargs="+",
        metavar="ID_OR_KEY",
        help="a request's id (digits), a str key, or a tuple key as a JSON array",
    )
    cancel.add_argument("--keys", action="store_true", help="take every ID_OR_KEY as a str key")
    cancel.add_argument("--schema", default="tickler", help=schema_help)
    retry = commands.add_parser("retry", help="queue failed or cancelled requests again, now")
    retry.add_argument("url", help=url_help)
    retry.add_argument("queue", help="the queue's name (its services' name)")
    retry.add_argument("ids", nargs="+", type=int, metavar="ID", help="a request's id")
    retry.add_argument("--schema", default="tickler", help=schema_help)
    migrate = commands.add_parser(
        "migrate", help="create the store's schema, or bring it up to date, with no service"
    )
    migrate.add_argument("url", help=url_help)
    migrate.add_argument("--schema", default="tickler", help=schema_help)
    web = commands.add_parser("web", help="serve the dashboard (needs the web extra)")
    web.add_argument("url", help=url_help)
    web.add_argument("--schema", default="tickler", help=schema_help)
    web.add_argument("--host", default="127.0.0.1", help="the address to bind (127.0.0.1)")
    web.add_argument("--port", type=int, default=8000, help="the port (8000)")
    web.add_argument("--read-only", action="store_true", help="show and take no actions")
    web.add_argument(
        "--basic-auth",
        metavar="USER:PASSWORD",
        help="require HTTP Basic auth (or set TICKLER_WEB_BASIC_AUTH=USER:PASSWORD)",
    )
    web.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="HOST",
        dest="allowed_hosts",
        help="a host name (no port) the dashboard answers to besides this machine's own"
        " ('*.example.com' for its subdomains); repeat it for more",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; whatever it prints shows the passwords of ``argv`` as ***."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    # argparse's errors quote what they reject, a URL given without "inspect" say.
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            args = parser.parse_args(argv)
    finally:
        sys.stderr.write(redact(errors.getvalue(), argv))
    secrets = [os.environ.get("TICKLER_WEB_BASIC_AUTH", "").partition(":")[2]]
    if getattr(args, "basic_auth", None):
        secrets.append(args.basic_auth.partition(":")[2])
    status = 0
    try:
        if args.command == "inspect":
            done = inspect_url(args.url, args.schema)
        elif args.command in ("pause", "resume"):
            done, warning = set_paused_url(
                args.url, args.schema, args.queue, args.command == "pause"
            )
            if warning is not None:
                print(redact(f"python -m tickler: {warning}", argv, secrets), file=sys.stderr)
        elif args.command == "cancel":
            done, every = cancel_url(args.url, args.schema, args.queue, args.targets, args.keys)
            status = 0 if every else 1
        elif args.command == "retry":
            done, every = retry_url(args.url, args.schema, args.queue, args.ids)
            status = 0 if every else 1
        elif args.command == "migrate":
            done = migrate_url(args.url, args.schema)
        else:
            return _web(args)
        print(redact(done, argv, secrets))
    except (ValueError, TypeError, StoreError) as exc:
        print(redact(f"python -m tickler: {exc}", argv, secrets), file=sys.stderr)
        return 2
    except Exception:
        sys.stderr.write(redact(traceback.format_exc(), argv, secrets))
        return 1
    return status


def _web(args: argparse.Namespace) -> int:
    """Serve the dashboard until interrupted."""
    basic_auth = _basic_auth(args.basic_auth)
    try:
        from .web import serve
    except ImportError as exc:
        raise ValueError(
            f"the dashboard needs the web extra: pip install 'trio-tickler[web]' ({exc})"
        ) from None
    with contextlib.suppress(KeyboardInterrupt):
        serve(
            args.url,
            schema=args.schema,
            host=args.host,
            port=args.port,
            read_only=args.read_only,
            basic_auth=basic_auth,
            allowed_hosts=args.allowed_hosts,
        )
    return 0


def inspect_url(url: str, schema: str) -> str:
    if url.startswith(("postgresql://", "postgres://")):
        return inspect_postgres(url, schema)
    if url.startswith(_PREFIX):
        return inspect_sqlite(Path(url[len(_PREFIX) :]))
    raise ValueError(f"{redact(url, [url])!r} is neither a sqlite:/// URL nor a postgresql:// DSN")


if __name__ == "__main__":
    sys.exit(main())
