"""python -m tickler: look at a store, pause and resume its queues.

- ``inspect URL``: each queue's counts by status and latest failures,
  whether it is paused, its per-group limits if it has any, and its busiest
  groups (the most running first, then the most ready).
- ``pause URL QUEUE``: the queue's services, in every process, claim nothing
  more (what they run goes on) until ``resume URL QUEUE``.

URL is sqlite:///relative.db, sqlite:////absolute.db, or a postgresql:// DSN
(with --schema, "tickler" by default). A password in the URL is never printed:
every message shows it as ***.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
import traceback
import urllib.parse
from collections.abc import Iterable, Sequence
from pathlib import Path

from ._stores import postgres, sqlite
from ._stores._sql import QueueReport

_PREFIX = "sqlite:///"
_LATEST_FAILURES = 5
_MASK = "***"

# A URL's user:password@, up to the last @ before a /: libpq and urllib split a
# password that holds @ differently, and both readings must be hidden.
_URL_PASSWORD = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^\s:/?#@'\"]*:)[^\s/'\"]*@")
# password=... in a key=value connection string or a URL's query: quoted, or a
# word; in a message, a word ends at a quote too.
_KEYWORD_PASSWORD = re.compile(r"\bpassword\s*=\s*('(?:[^'\\]|\\.)*'?|\S*)", re.IGNORECASE)
_MESSAGE_PASSWORD = re.compile(r"(\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'?|[^\s'\"]*)", re.IGNORECASE)
_QUERY_PASSWORD = re.compile(r"[?&]password=([^&#\s]*)", re.IGNORECASE)


def _passwords(source: str) -> set[str]:
    """The passwords ``source`` may hold, as written and decoded, and their parts.

    ``source`` is a URL or a key=value connection string as the user typed it,
    well formed or not: libpq quotes a malformed one, or a piece of it, in its errors.
    """
    found: set[str] = set()
    for match in re.finditer(r"://(\S*)", source):
        rest = match.group(1)
        libpq = re.match(r"[^@/]*(?=@)", rest)  # libpq: user info ends at the first @ or /
        readings = [
            libpq.group() if libpq else "",
            re.split(r"[/?#]", rest, maxsplit=1)[0].rpartition("@")[0],  # urllib
            re.split(r"[?#]", rest, maxsplit=1)[0].rpartition("@")[0],  # a / in the password
        ]
        for userinfo in readings:
            if ":" in userinfo:
                password = userinfo.partition(":")[2]
                found.add(password)
                found.update(re.split(r"[@/?#]", password))
        found.update(_QUERY_PASSWORD.findall(rest))
    for match in _KEYWORD_PASSWORD.finditer(source):
        value = match.group(1)
        if value.startswith("'"):
            value = value[1:-1] if len(value) > 1 and value.endswith("'") else value[1:]
        found.update((match.group(1), value, re.sub(r"\\(.)", r"\1", value)))
    found.update([urllib.parse.unquote(password) for password in found])
    found.discard("")
    return found


def redact(text: str, sources: Iterable[str] = ()) -> str:
    """``text`` with the passwords of ``sources``, and those of URLs in it, as ***."""
    secrets: set[str] = set()
    for source in sources:
        secrets |= _passwords(source)
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, _MASK)
    text = _URL_PASSWORD.sub(rf"\1{_MASK}@", text)
    return _MESSAGE_PASSWORD.sub(rf"\1{_MASK}", text)


def _limit(limit: tuple[int | None, int | None, float]) -> str:
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
        for group, running, ready in found.groups:
            lines.append(f"  group {group!r}: {running} running, {ready} ready")
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


def set_paused_url(url: str, schema: str, queue: str, paused: bool) -> str:
    """Pause or resume ``queue`` of the store at ``url``; the line saying what was done.

    Raises ValueError if the store cannot be reached or is not a tickler store.
    """
    if url.startswith(("postgresql://", "postgres://")):
        try:
            postgres.set_paused(url, schema, queue, paused)
        except ValueError as exc:
            raise ValueError(redact(str(exc), [url])) from None
        where = f"{redact(url, [url])} (schema {schema!r})"
    elif url.startswith(_PREFIX):
        sqlite.set_paused(Path(url[len(_PREFIX) :]), queue, paused)
        where = url
    else:
        raise ValueError(
            f"{redact(url, [url])!r} is neither a sqlite:/// URL nor a postgresql:// DSN"
        )
    done = "paused" if paused else "resumed"
    more = "its services claim nothing until it is resumed" if paused else "its services claim"
    return f"{done} queue {queue!r} of {where}: {more}"


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
    try:
        if args.command == "inspect":
            done = inspect_url(args.url, args.schema)
        else:
            done = set_paused_url(args.url, args.schema, args.queue, args.command == "pause")
        print(redact(done, argv))
    except ValueError as exc:
        print(redact(f"python -m tickler: {exc}", argv), file=sys.stderr)
        return 2
    except Exception:
        sys.stderr.write(redact(traceback.format_exc(), argv))
        return 1
    return 0


def inspect_url(url: str, schema: str) -> str:
    if url.startswith(("postgresql://", "postgres://")):
        return inspect_postgres(url, schema)
    if url.startswith(_PREFIX):
        return inspect_sqlite(Path(url[len(_PREFIX) :]))
    raise ValueError(f"{redact(url, [url])!r} is neither a sqlite:/// URL nor a postgresql:// DSN")


if __name__ == "__main__":
    sys.exit(main())
