"""python -m tickler: inspect, pause and resume, which never print a password, whatever the URL."""

from __future__ import annotations

import socket
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tickler.__main__ import inspect_postgres, main, redact

from .store_backends import owner_id

SECRET = "SECRET"  # noqa: S105 - the word the output must never hold


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A port on 127.0.0.1 that refuses connections: bound, never listening."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def inspect(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(  # noqa: S603 - our own interpreter running our own module
        [sys.executable, "-m", "tickler", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )


def test_unknown_scheme_hides_the_password() -> None:
    result = inspect("inspect", f"postgres+psycopg://u:{SECRET}@h/db")
    assert SECRET not in result.stdout + result.stderr
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == (
        "python -m tickler: 'postgres+psycopg://u:***@h/db'"
        " is neither a sqlite:/// URL nor a postgresql:// DSN\n"
    )


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql://u:{SECRET}@127.0.0.1:{{port}}/db",
        f"postgres://u:{SECRET}@127.0.0.1:{{port}}/db",
        f"postgresql://u@127.0.0.1:{{port}}/db?password={SECRET}",
        f"postgresql://u:pa%20{SECRET}@127.0.0.1:{{port}}/db",
    ],
)
def test_refused_connection_hides_the_password(url: str, closed_port: int) -> None:
    result = inspect("inspect", url.format(port=closed_port))
    assert SECRET not in result.stdout + result.stderr
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith("python -m tickler: cannot connect: ")
    assert "127.0.0.1" in result.stderr


@pytest.mark.parametrize(
    "dsn", [f"host=127.0.0.1 port={{port}} password={SECRET}", f"password='{SECRET} x' host=h"]
)
def test_key_value_dsn_hides_the_password(dsn: str, closed_port: int) -> None:
    result = inspect("inspect", dsn.format(port=closed_port))
    assert SECRET not in result.stdout + result.stderr
    assert result.returncode == 2
    assert result.stderr.startswith("python -m tickler: '")
    assert "password=***" in result.stderr
    assert "is neither a sqlite:/// URL nor a postgresql:// DSN" in result.stderr


def test_usage_errors_hide_the_password() -> None:
    """argparse quotes a URL given without the command; the password is hidden there too."""
    result = inspect(f"postgresql://u:{SECRET}@h/db")
    assert SECRET not in result.stdout + result.stderr
    assert result.returncode == 2
    assert "invalid choice: 'postgresql://u:***@h/db'" in result.stderr


@pytest.mark.parametrize(
    ("dsn", "shown"),
    [
        # libpq quotes the whole URI, or the piece it cannot decode.
        (f"postgresql://u:{SECRET}@[127.0.0.1:{{port}}/db", "postgresql://u:***@[127.0.0.1"),
        (f"postgresql://u:{SECRET}%zz@127.0.0.1:{{port}}/db", 'percent-encoded token: "***"'),
        (f"postgresql://u:{SECRET}%00@127.0.0.1:{{port}}/db", 'percent-encoded value: "***"'),
        # An unencoded @ ends libpq's password early: the rest becomes the host.
        (f"postgresql://u:pw@{SECRET}@127.0.0.1:{{port}}/db", "'***@127.0.0.1'"),
        (f"postgresql://u:{SECRET}/x@127.0.0.1:{{port}}/db", "cannot connect: "),
        (f"host=127.0.0.1 port={{port}} password={SECRET}", "Connection refused"),
        (f"host=127.0.0.1 port={{port}} password={SECRET} junk", 'missing "=" after "junk"'),
        (f"host=127.0.0.1 port={{port}} password='{SECRET}", "unterminated quoted string"),
    ],
)
def test_psycopg_errors_hide_the_password(dsn: str, shown: str, closed_port: int) -> None:
    with pytest.raises(ValueError, match=r"^cannot connect: ") as caught:
        inspect_postgres(dsn.format(port=closed_port), "tickler")
    assert SECRET not in str(caught.value)
    assert shown in str(caught.value)


@pytest.mark.parametrize(
    ("text", "redacted"),
    [
        ("postgresql://u:pw@h/db", "postgresql://u:***@h/db"),
        ("postgresql://u@h:5432/db?user=me@x", "postgresql://u@h:5432/db?user=me@x"),
        ("see redis://:pw@h:6379/0 and x", "see redis://:***@h:6379/0 and x"),
        ("host=h password=pw dbname=d", "host=h password=*** dbname=d"),
        ("host=h password='p w' dbname=d", "host=h password=*** dbname=d"),
        ("'host=h PASSWORD=pw'", "'host=h PASSWORD=***'"),
        (
            "postgresql://h/db?sslmode=require&password=pw",
            "postgresql://h/db?sslmode=require&password=***",
        ),
        ("no password here", "no password here"),
    ],
)
def test_redact_finds_passwords_in_text(text: str, redacted: str) -> None:
    assert redact(text) == redacted


def test_redact_hides_every_reading_of_the_source() -> None:
    """A password from the source is hidden wherever it shows, encoded or decoded."""
    source = "postgresql://u:p%40ss@h/db"
    assert redact("role p@ss, token p%40ss", [source]) == "role ***, token ***"


def test_sqlite_errors_still_name_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing.db"
    assert main(["inspect", f"sqlite:///{missing}"]) == 2
    assert capsys.readouterr().err == f"python -m tickler: {missing}: no such file\n"


# -- pause and resume


def test_pause_and_resume_a_sqlite_queue(tmp_path: Path) -> None:
    import tickler
    from tickler._stores._seam import Batch

    path = tmp_path / "queue.db"
    store = tickler.SqliteStore(path)
    store.create_schema()
    with sqlite3.connect(path) as connection:
        store.enqueue_in(connection, "jobs", 1)
    connection.close()
    url = f"sqlite:///{path}"

    result = inspect("pause", url, "jobs")
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == (
        f"paused queue 'jobs' of {url}: its services claim nothing until it is resumed\n"
    )
    shown = inspect("inspect", url).stdout
    assert shown.startswith("queue 'jobs' (paused): 1 queued, ")
    session = store.connect()
    try:
        assert session.statistics("jobs")["paused"] == 1
        assert session.run("jobs", owner_id("me"), 30.0, 86400.0, Batch(claim=5)).claimed == []
        result = inspect("resume", url, "jobs")
        assert (result.returncode, result.stderr) == (0, "")
        assert result.stdout == f"resumed queue 'jobs' of {url}: its services claim again\n"
        assert inspect("inspect", url).stdout.startswith("queue 'jobs': 1 queued, ")
        assert len(session.run("jobs", owner_id("me"), 30.0, 86400.0, Batch(claim=5)).claimed) == 1
    finally:
        session.close()
    # A queue with no requests yet can be paused, with a warning, and shows.
    result = inspect("pause", url, "later")
    assert result.returncode == 0
    assert result.stderr.startswith("python -m tickler: warning: queue 'later' ")
    assert "queue 'later' (paused): 0 queued, " in inspect("inspect", url).stdout


def test_pause_refuses_what_is_not_a_tickler_store(tmp_path: Path) -> None:
    missing = tmp_path / "missing.db"
    result = inspect("pause", f"sqlite:///{missing}", "jobs")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == f"python -m tickler: {missing}: no such file\n"
    assert not missing.exists()
    foreign = tmp_path / "foreign.db"
    with sqlite3.connect(foreign) as connection:
        connection.execute("CREATE TABLE mine (x)")
    connection.close()
    result = inspect("resume", f"sqlite:///{foreign}", "jobs")
    assert result.returncode == 2
    assert result.stderr == f"python -m tickler: {foreign}: not a tickler store\n"
    result = inspect("pause", f"postgres+psycopg://u:{SECRET}@h/db", "jobs")
    assert SECRET not in result.stdout + result.stderr
    assert result.returncode == 2
    assert "is neither a sqlite:/// URL nor a postgresql:// DSN" in result.stderr


def test_pause_and_resume_a_postgres_queue_without_showing_the_password(
    postgres_dsn: str, postgres_schema: str
) -> None:
    import psycopg
    import psycopg.conninfo

    import tickler

    store = tickler.PostgresStore(postgres_dsn, schema=postgres_schema)
    store.create_schema()
    with psycopg.connect(postgres_dsn, autocommit=True) as connection:
        store.enqueue_in(connection, "jobs", 1)
    # The server trusts the test's connections: the password is sent, never needed.
    parts = psycopg.conninfo.conninfo_to_dict(postgres_dsn)
    url = (
        f"postgresql://{parts.get('user', 'postgres')}:{SECRET}@{parts.get('host', '127.0.0.1')}"
        f":{parts.get('port', 5432)}/{parts.get('dbname', 'postgres')}"
    )
    shown_url = url.replace(SECRET, "***")
    with psycopg.connect(postgres_dsn, autocommit=True) as listening:
        listening.execute(f'LISTEN "tickler_{postgres_schema}"')
        result = inspect("pause", url, "jobs", "--schema", postgres_schema)
        assert SECRET not in result.stdout + result.stderr
        assert (result.returncode, result.stderr) == (0, "")
        assert result.stdout == (
            f"paused queue 'jobs' of {shown_url} (schema {postgres_schema!r}):"
            " its services claim nothing until it is resumed\n"
        )
        # The replicas listening are woken.
        notified = [n.payload for n in listening.notifies(timeout=5, stop_after=1)]
        assert notified == ["jobs"]
    shown = inspect("inspect", url, "--schema", postgres_schema)
    assert SECRET not in shown.stdout + shown.stderr
    assert shown.stdout.startswith("queue 'jobs' (paused): 1 queued, ")
    session = store.connect()
    try:
        assert session.statistics("jobs")["paused"] == 1
    finally:
        session.close()
    result = inspect("resume", url, "jobs", "--schema", postgres_schema)
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == (
        f"resumed queue 'jobs' of {shown_url} (schema {postgres_schema!r}):"
        " its services claim again\n"
    )
    assert inspect("inspect", url, "--schema", postgres_schema).stdout.startswith(
        "queue 'jobs': 1 queued, "
    )
    # A schema that is not tickler's is refused, the password hidden.
    result = inspect("pause", url, "jobs", "--schema", "no_such_schema")
    assert SECRET not in result.stdout + result.stderr
    assert result.returncode == 2
    assert result.stderr == "python -m tickler: schema 'no_such_schema': not a tickler store\n"


def test_pause_with_a_refused_connection_hides_the_password(closed_port: int) -> None:
    result = inspect("pause", f"postgresql://u:{SECRET}@127.0.0.1:{closed_port}/db", "jobs")
    assert SECRET not in result.stdout + result.stderr
    assert result.returncode == 2
    assert result.stderr.startswith("python -m tickler: cannot connect: ")


def _mail(store: Any, connect: Any) -> None:
    with connect() as connection:
        store.enqueue_in(connection, "mail", 1)
        connection.commit()


def test_pause_warns_of_a_queue_it_does_not_know(
    kind: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """With queues mail and audit known (audit by its pause alone), pausing "mial" pauses
    it and warns, naming them; pausing mail warns of nothing."""
    url, where = filled(kind, tmp_path, _mail)
    result = inspect("pause", *url, "audit")
    assert result.returncode == 0
    result = inspect("pause", *url, "mial")
    assert result.returncode == 0
    assert result.stderr == (
        "python -m tickler: warning: queue 'mial' has no requests and was never paused or"
        " limited (a misspelt name?); known queues: 'audit', 'mail'\n"
    )
    assert result.stdout == (
        f"paused queue 'mial' of {where}: its services claim nothing until it is resumed\n"
    )
    result = inspect("pause", *url, "mail")
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == (
        f"paused queue 'mail' of {where}: its services claim nothing until it is resumed\n"
    )
    result = inspect("resume", *url, "mail")
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == f"resumed queue 'mail' of {where}: its services claim again\n"


# -- Limits and groups


def _busy_groups(store: object, connect: object) -> None:
    """Requests of groups a (3), b (2), c (1) and none (1); one claim under limits takes one
    of a's, one of b's, c's and the ungrouped one."""
    from tickler._stores._seam import Batch, GroupLimit

    with connect() as connection:  # type: ignore[operator]
        store.enqueue_many_in(connection, "jobs", [1, 2, 3], group="a")  # type: ignore[attr-defined]
        store.enqueue_many_in(connection, "jobs", [4, 5], group="b")  # type: ignore[attr-defined]
        store.enqueue_in(connection, "jobs", 6, group="c")  # type: ignore[attr-defined]
        store.enqueue_in(connection, "jobs", 7)  # type: ignore[attr-defined]
        connection.commit()
    session = store.connect()  # type: ignore[attr-defined]
    try:
        limits = {"*": GroupLimit(1, None, 1.0), "c": GroupLimit(None, 5, 2.5)}
        result = session.run("jobs", owner_id("me"), 30.0, 86400.0, Batch(claim=10, limits=limits))
        assert len(result.claimed) == 4
        assert result.limited == 3
    finally:
        session.close()


_LIMITS_SHOWN = (
    "  limits by group: '*' concurrency 1; 'c' rate 5 per 2.5s\n"
    "  group 'a': 2 queued, 1 claimed\n"
    "  group 'b': 1 queued, 1 claimed\n"
    "  group 'c': 1 claimed\n"
)


def filled(request: pytest.FixtureRequest, tmp_path: Path, fill: Any) -> tuple[list[str], str]:
    """A store that ``fill(store, connect)`` filled, a SQLite file or a PostgreSQL schema as
    ``request.param`` says: the URL and options a command takes, and the store as its
    messages name it."""
    import contextlib

    import tickler

    if request.param == "sqlite":
        path = tmp_path / "queue.db"
        store: Any = tickler.SqliteStore(path)
        store.create_schema()
        fill(store, lambda: contextlib.closing(sqlite3.connect(path)))
        return [f"sqlite:///{path}"], f"sqlite:///{path}"
    import psycopg

    dsn = request.getfixturevalue("postgres_dsn")
    schema = request.getfixturevalue("postgres_schema")
    store = tickler.PostgresStore(dsn, schema=schema)
    store.create_schema()
    fill(store, lambda: psycopg.connect(dsn))
    return [dsn, "--schema", schema], f"{dsn} (schema {schema!r})"


def inspected(request: pytest.FixtureRequest, tmp_path: Path, fill: Any) -> str:
    """``python -m tickler inspect``'s output on the store ``filled()`` gives."""
    result = inspect("inspect", *filled(request, tmp_path, fill)[0])
    assert (result.returncode, result.stderr) == (0, "")
    return result.stdout


@pytest.fixture(params=["sqlite", "postgres"])
def kind(request: pytest.FixtureRequest) -> pytest.FixtureRequest:
    """The store to inspect, for inspected()."""
    return request


def test_inspect_shows_a_queues_limits_and_busiest_groups(
    kind: pytest.FixtureRequest, tmp_path: Path
) -> None:
    first, rest = inspected(kind, tmp_path, _busy_groups).split("\n", 1)
    assert first.startswith("queue 'jobs': 3 queued, 0 scheduled, 4 claimed, 0 running, ")
    assert rest == _LIMITS_SHOWN


def test_inspect_shows_the_five_busiest_groups(tmp_path: Path) -> None:
    import tickler

    path = tmp_path / "queue.db"
    store = tickler.SqliteStore(path)
    store.create_schema()
    with sqlite3.connect(path) as connection:
        for n in range(8):
            store.enqueue_many_in(connection, "jobs", range(n + 1), group=f"g{n}")
    connection.close()
    shown = inspect("inspect", f"sqlite:///{path}").stdout
    assert "limits" not in shown
    groups = [line for line in shown.splitlines() if line.startswith("  group ")]
    assert groups == [f"  group 'g{n}': {n + 1} queued" for n in range(7, 2, -1)]


def _every_live_state(store: object, connect: object) -> None:
    """Rows of group g in each live state: 4 queued, 2 scheduled, 1 claimed (not started),
    1 running (started) and 1 retrying."""
    import time

    from tickler._stores._seam import Batch, Outcome, OutcomeKind

    with connect() as connection:  # type: ignore[operator]
        store.enqueue_many_in(connection, "jobs", range(7), group="g")  # type: ignore[attr-defined]
        store.enqueue_many_in(connection, "jobs", [7, 8], group="g", delay=3600)  # type: ignore[attr-defined]
        connection.commit()
    session = store.connect()  # type: ignore[attr-defined]
    try:
        claimed = [
            row.id
            for row in session.run("jobs", owner_id("me"), 30.0, 86400.0, Batch(claim=3)).claimed
        ]
        retry = Outcome(
            OutcomeKind.RETRYING, claimed[1], time.time() + 3600, None, "E", "again", "tb"
        )
        session.run(
            "jobs", owner_id("me"), 30.0, 86400.0, Batch(started=[claimed[0]], outcomes=[retry])
        )
    finally:
        session.close()


_EVERY_STATE_SHOWN = (
    "queue 'jobs': 4 queued, 2 scheduled, 1 claimed, 1 running, 1 retrying, 0 succeeded,"
    " 0 failed, 0 cancelled\n"
    "  group 'g': 4 queued, 2 scheduled, 1 claimed, 1 running, 1 retrying\n"
)


def test_inspect_names_each_state_of_a_group(kind: pytest.FixtureRequest, tmp_path: Path) -> None:
    assert inspected(kind, tmp_path, _every_live_state) == _EVERY_STATE_SHOWN
