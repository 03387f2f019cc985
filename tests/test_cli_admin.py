"""python -m tickler cancel|retry|migrate|web, run as a real process on a real SQLite file and
a real PostgreSQL schema; no output holds a password."""

from __future__ import annotations

import base64
import os
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

import tickler
from tickler.__main__ import open_store

SECRET = "SECRET"  # noqa: S105 - the word the output must never hold


def tickler_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(  # noqa: S603 - our own interpreter running our own module
        [sys.executable, "-m", "tickler", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def with_password(dsn: str) -> str:
    """The test server's DSN as a URL holding a password (the server trusts, and ignores it)."""
    import psycopg.conninfo

    parts = psycopg.conninfo.conninfo_to_dict(dsn)
    host, port = parts.get("host", "127.0.0.1"), parts.get("port", 5432)
    return f"postgresql://{parts.get('user', 'postgres')}:{SECRET}@{host}:{port}/{parts['dbname']}"


@pytest.fixture(params=["sqlite", "postgres"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[list[str], Any]:
    """(the URL and options the CLI takes, a store on it), for each store."""
    if request.param == "sqlite":
        path = tmp_path / "queue.db"
        return [f"sqlite:///{path}"], tickler.SqliteStore(path)
    dsn = request.getfixturevalue("postgres_dsn")
    schema = request.getfixturevalue("postgres_schema")
    return [with_password(dsn), "--schema", schema], tickler.PostgresStore(dsn, schema=schema)


def connect(store: Any) -> Any:
    if isinstance(store, tickler.SqliteStore):
        return sqlite3.connect(store.path)
    import psycopg

    return psycopg.connect(store.dsn)


def enqueue(store: Any, requests: list[int], **options: Any) -> list[int]:
    connection = connect(store)
    try:
        ids: list[int] = store.enqueue_many_in(connection, "jobs", requests, **options)
        connection.commit()
    finally:
        connection.close()
    return ids


def states(store: Any) -> dict[int, str]:
    connection = connect(store)
    table = "tickler_requests"
    if isinstance(store, tickler.PostgresStore):
        table = f'"{store.schema}".tickler_requests'
    try:
        rows = connection.execute(f"SELECT id, state FROM {table} ORDER BY id").fetchall()  # noqa: S608
    finally:
        connection.close()
    return {int(request_id): str(state) for request_id, state in rows}


def shown(url: list[str]) -> str:
    return url[0].replace(SECRET, "***")


def test_migrate_creates_and_upgrades_the_schema(location: tuple[list[str], Any]) -> None:
    url, store = location
    for _ in range(2):  # again: nothing to do
        result = tickler_cli("migrate", *url)
        assert SECRET not in result.stdout + result.stderr
        assert (result.returncode, result.stderr) == (0, "")
        assert result.stdout.startswith(shown(url))
        assert "tickler schema version" in result.stdout
    assert enqueue(store, [1]) == [1]


def test_cancel_by_id_and_key_then_retry(location: tuple[list[str], Any]) -> None:
    url, store = location
    store.create_schema()
    ids = enqueue(store, [1, 2, 3], key=lambda r: f"k{r}")
    ids += enqueue(store, [4], key=lambda r: ("order", r))
    result = tickler_cli("cancel", *url, "jobs", str(ids[0]), "k2", '["order", 4]')
    assert SECRET not in result.stdout + result.stderr
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.splitlines() == [
        f"cancelled #{ids[0]}",
        f"cancelled key 'k2' (#{ids[1]})",
        f"cancelled key '[\"order\", 4]' (#{ids[3]})",
    ]
    assert states(store) == {
        ids[0]: "cancelled",
        ids[1]: "cancelled",
        ids[2]: "queued",
        ids[3]: "cancelled",
    }
    again = tickler_cli("cancel", "--keys", *url, "jobs", str(ids[0]), "k3")
    assert again.returncode == 1
    assert again.stdout.splitlines() == [
        f"not cancelled: key '{ids[0]}' is final, or not a request of 'jobs'",
        f"cancelled key 'k3' (#{ids[2]})",
    ]
    retried = tickler_cli("retry", *url, "jobs", str(ids[0]), str(ids[1]))
    assert SECRET not in retried.stdout + retried.stderr
    assert (retried.returncode, retried.stderr) == (0, "")
    assert retried.stdout.splitlines() == [
        f"queued #{ids[0]} again: it runs at the next claim",
        f"queued #{ids[1]} again: it runs at the next claim",
    ]
    assert states(store)[ids[0]] == states(store)[ids[1]] == "queued"
    refused = tickler_cli("retry", *url, "jobs", str(ids[0]), "999")
    assert refused.returncode == 1
    assert refused.stdout.splitlines()[1] == (
        "not retried: #999 is not a failed or cancelled request of 'jobs',"
        " or a later request holds its key"
    )
    bad = tickler_cli("retry", *url, "jobs", "seven")
    assert bad.returncode == 2
    assert "invalid int value: 'seven'" in bad.stderr
    assert SECRET not in bad.stdout + bad.stderr


def test_cancel_and_retry_check_every_target_before_acting(
    location: tuple[list[str], Any],
) -> None:
    """A bad target among good ones: nothing is cancelled or retried, and the message
    names the bad one."""
    url, store = location
    store.create_schema()
    ids = enqueue(store, [1, 2], key=lambda r: f"k{r}")
    result = tickler_cli("cancel", *url, "jobs", "k1", str(ids[1]), "[true]")
    assert states(store) == {ids[0]: "queued", ids[1]: "queued"}
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        "python -m tickler: ID_OR_KEY '[true]': key must be a str or a tuple of strs and ints"
        " for a service with a store, not bool; nothing was cancelled\n"
    )
    too_long = "x" * 1001
    result = tickler_cli("cancel", "--keys", *url, "jobs", "k1", too_long)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.startswith(f"python -m tickler: ID_OR_KEY {too_long!r}: key must be")
    assert states(store) == {ids[0]: "queued", ids[1]: "queued"}
    assert tickler_cli("cancel", *url, "jobs", "k1").returncode == 0
    result = tickler_cli("retry", *url, "jobs", str(ids[0]), "seven")
    assert (result.returncode, result.stdout) == (2, "")
    assert "argument ID: invalid int value: 'seven'" in result.stderr
    assert states(store) == {ids[0]: "cancelled", ids[1]: "queued"}


def test_errors_show_no_password(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        for command in (["migrate"], ["cancel"], ["retry"]):
            more = [] if command == ["migrate"] else ["jobs", "1"]
            url = f"postgresql://u:{SECRET}@127.0.0.1:{port}/db"
            result = tickler_cli(*command, url, *more)
            assert SECRET not in result.stdout + result.stderr
            assert result.returncode == 2
            assert result.stderr.startswith("python -m tickler: cannot connect to PostgreSQL")
    missing = tickler_cli("cancel", f"sqlite:///{tmp_path}/none.db", "jobs", "1")
    assert (missing.returncode, missing.stderr) == (
        2,
        f"python -m tickler: {tmp_path}/none.db: no such file\n",
    )
    assert not (tmp_path / "none.db").exists()
    odd = tickler_cli("web", f"mysql://u:{SECRET}@h/db")
    assert odd.returncode == 2
    assert SECRET not in odd.stdout + odd.stderr
    auth = tickler_cli("web", f"sqlite:///{tmp_path}/q.db", "--basic-auth", f"admin{SECRET}")
    assert auth.returncode == 2
    assert SECRET not in auth.stdout + auth.stderr
    assert "--basic-auth (or TICKLER_WEB_BASIC_AUTH) must be USER:PASSWORD" in auth.stderr


def test_open_store_reads_the_urls_inspect_takes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such file"):
        open_store(f"sqlite:///{tmp_path}/none.db")
    made = open_store(f"sqlite:///{tmp_path}/new.db", create=True)
    assert isinstance(made, tickler.SqliteStore)
    assert made.path == tmp_path / "new.db"
    pg = open_store(f"postgresql://u:{SECRET}@h/db", schema="jobs")
    assert isinstance(pg, tickler.PostgresStore)
    assert pg.schema == "jobs"
    with pytest.raises(ValueError, match=r"'http://u:\*\*\*@h' is neither"):
        open_store(f"http://u:{SECRET}@h")


def test_web_serves_the_dashboard_behind_basic_auth(tmp_path: Path) -> None:
    pytest.importorskip("tickler.web")
    store = tickler.SqliteStore(tmp_path / "q.db")
    store.create_schema()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(  # noqa: S603 - our own interpreter running our own module
        [sys.executable, "-m", "tickler", "web", f"sqlite:///{store.path}", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TICKLER_WEB_BASIC_AUTH": f"admin:{SECRET}"},
    )
    try:
        url = f"http://127.0.0.1:{port}/"
        deadline = time.monotonic() + 30
        refused = 0
        while True:
            try:
                urllib.request.urlopen(url, timeout=5)
            except urllib.error.HTTPError as exc:
                refused = exc.code
                break
            except OSError:
                assert server.poll() is None, server.communicate()
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert refused == 401  # no credentials
        token = base64.b64encode(f"admin:{SECRET}".encode()).decode()
        request = urllib.request.Request(url, headers={"Authorization": f"Basic {token}"})
        with urllib.request.urlopen(request, timeout=10) as answer:  # noqa: S310 - our own server
            assert answer.status == 200
    finally:
        server.terminate()
        out, err = server.communicate(timeout=30)
    assert SECRET not in out + err
