"""store.admin(read_only=True), and the read-only dashboard on it: nothing is written.

On SQLite: an application's own file, opened by a read-only admin or dashboard, keeps
its bytes, its tables and its journal mode, whether it holds tickler's tables or not.
On PostgreSQL: a role with CONNECT, USAGE on the schema and SELECT on its tables reads
every page; a missing schema is not created, an older one not migrated. And the admin
holds one connection: no liveness connection beside it.
"""

from __future__ import annotations

import hashlib
import sqlite3
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

import tickler
import tickler.web

from .test_web import served


def snapshot(path: Path) -> dict[str, Any]:
    """Everything of a SQLite file a write would change, and the files beside it."""
    data = path.read_bytes()
    db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        master = db.execute("SELECT type, name, sql FROM sqlite_master ORDER BY name").fetchall()
        (mode,) = db.execute("PRAGMA journal_mode").fetchone()
    finally:
        db.close()
    return {
        "sha256": hashlib.sha256(data).hexdigest(),
        "mtime_ns": path.stat().st_mtime_ns,
        "sqlite_master": master,
        "journal_mode": mode,
        "files": sorted(p.name for p in path.parent.iterdir()),
    }


def applications_file(path: Path) -> None:
    """An application's database: a table of its own, in the default journal mode."""
    db = sqlite3.connect(path)
    with db:
        db.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, total REAL)")
        db.execute("INSERT INTO orders (total) VALUES (12.5)")
    db.close()


def read_everything(admin: tickler.Admin, queue: str, request_id: int) -> None:
    """Every read the admin has, in one Trio run."""

    async def run() -> None:
        assert await admin.queues() == [queue]
        assert (await admin.counts(queue))["queued"] == 2
        (overview,) = await admin.overview()
        assert overview.counts["queued"] == 2
        page = await admin.requests(queue, limit=1)
        assert [row.id for row in page.rows] == [request_id]
        assert page.next is not None
        found = await admin.lookup(queue, request_id)
        assert found is not None
        assert found.request == {"n": 2}
        assert await admin.count_where(queue, state="queued") == 2
        assert await admin.replicas() == []

    trio.run(run)


def refuses_every_write(admin: tickler.Admin, queue: str, request_id: int) -> None:
    async def run() -> None:
        calls: list[tuple[Callable[..., Awaitable[object]], tuple[object, ...]]] = [
            (admin.cancel, (queue, request_id)),
            (admin.retry, (queue, request_id)),
            (admin.pause, (queue,)),
            (admin.resume, (queue,)),
            (admin.cancel_where, (queue,)),
            (admin.retry_where, (queue,)),
        ]
        for call, args in calls:
            with pytest.raises(PermissionError, match=r"^<read-only admin of .*: \w+ refused$"):
                await call(*args)

    trio.run(run)


def shows_every_page(store: Any, queue: str, request_id: int) -> None:
    """The read-only dashboard on ``store`` answers each of its pages."""
    import httpx

    paths = ["/", f"/requests?queue={queue}", f"/request?queue={queue}&id={request_id}"]
    with (
        served(tickler.web.app(store, read_only=True)) as url,
        httpx.Client(base_url=url) as client,
    ):
        statuses = {path: client.get(path).status_code for path in [*paths, "/replicas"]}
    assert statuses == dict.fromkeys([*paths, "/replicas"], 200)


# -- SQLite


def test_a_read_only_admin_creates_nothing_in_an_applications_file(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    applications_file(path)
    before = snapshot(path)
    assert before["journal_mode"] == "delete"
    store = tickler.SqliteStore(path)
    admin = store.admin(read_only=True)
    with pytest.raises(tickler.StoreError, match="has no tickler tables yet, and a read-only"):
        trio.run(admin.queues)
    trio.run(admin.aclose)
    with served(tickler.web.app(store, read_only=True)) as url:
        import httpx

        page = httpx.get(url + "/")
    assert page.status_code == 500
    assert "has no tickler tables yet" in page.text
    assert snapshot(path) == before


def test_a_read_only_admin_and_dashboard_read_an_applications_file_unchanged(
    tmp_path: Path,
) -> None:
    """The file holds tickler's tables beside the application's, in its own journal mode
    (delete): every read, and every page, leaves it as it was."""
    path = tmp_path / "app.db"
    applications_file(path)
    store = tickler.SqliteStore(path)
    store.create_schema()
    db = sqlite3.connect(path)
    with db:
        _, second = (store.enqueue_in(db, "jobs", {"n": n}) for n in (1, 2))
    db.execute("PRAGMA journal_mode = DELETE")  # the application's choice, kept
    db.close()
    before = snapshot(path)
    assert before["journal_mode"] == "delete"
    assert "app.db-tickler-live" not in before["files"]

    admin = store.admin(read_only=True)
    read_everything(admin, "jobs", second)
    refuses_every_write(admin, "jobs", second)
    trio.run(admin.aclose)
    assert snapshot(path) == before
    shows_every_page(store, "jobs", second)
    assert snapshot(path) == before


def test_a_read_only_admin_does_not_migrate_an_older_file(tmp_path: Path) -> None:
    from tickler._stores import sqlite as sqlite_store

    path = tmp_path / "queue.db"
    store = tickler.SqliteStore(path)
    store.create_schema()
    db = sqlite3.connect(path)
    with db:
        db.execute("DROP TABLE tickler_owners")  # as version 7 had it
        db.execute("UPDATE tickler_schema SET version = 7")
    db.execute("PRAGMA journal_mode = DELETE")
    db.close()
    before = snapshot(path)
    admin = store.admin(read_only=True)
    with pytest.raises(
        tickler.StoreError,
        match=rf"schema version 7; a read-only admin reads version {sqlite_store.SCHEMA_VERSION}"
        " and migrates nothing",
    ):
        trio.run(admin.counts, "jobs")
    trio.run(admin.aclose)
    assert snapshot(path) == before


def test_a_read_only_admin_of_a_missing_file_creates_none(tmp_path: Path) -> None:
    admin = tickler.SqliteStore(tmp_path / "nowhere.db").admin(read_only=True)
    with pytest.raises(tickler.StoreError, match="no such file"):
        trio.run(admin.queues)
    assert list(tmp_path.iterdir()) == []


def test_read_only_must_be_a_bool(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"^read_only must be a bool$"):
        tickler.SqliteStore(tmp_path / "q.db").admin(read_only=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^read_only must be a bool$"):
        tickler.PostgresStore("postgresql://", schema="t").admin(read_only="yes")  # type: ignore[arg-type]


# -- PostgreSQL


@pytest.fixture
def reader(postgres_dsn: str, postgres_schema: str) -> Iterator[str]:
    """A DSN of a role of its own that may connect, use the schema and read its tables:
    nothing else. The role is dropped afterwards."""
    import psycopg
    import psycopg.conninfo

    role = f"tickler_reader_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_dsn, autocommit=True) as db:
        database = db.info.dbname
        db.execute(f"CREATE ROLE {role} LOGIN NOINHERIT")
        db.execute(f'GRANT CONNECT ON DATABASE "{database}" TO {role}')
    try:
        yield psycopg.conninfo.make_conninfo(postgres_dsn, user=role)
    finally:
        with psycopg.connect(postgres_dsn, autocommit=True) as db:
            db.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                (role,),
            )
            db.execute(f"DROP OWNED BY {role}")
            db.execute(f'REVOKE CONNECT ON DATABASE "{database}" FROM {role}')
            db.execute(f"DROP ROLE {role}")


def grant_reading(dsn: str, schema: str, role_dsn: str) -> None:
    import psycopg
    import psycopg.conninfo

    role = psycopg.conninfo.conninfo_to_dict(role_dsn)["user"]
    with psycopg.connect(dsn, autocommit=True) as db:
        db.execute(f'GRANT USAGE ON SCHEMA "{schema}" TO {role}')
        db.execute(f'GRANT SELECT ON ALL TABLES IN SCHEMA "{schema}" TO {role}')


def filled_schema(dsn: str, schema: str) -> int:
    """The schema created, two requests enqueued: the id of the second."""
    import psycopg

    store = tickler.PostgresStore(dsn, schema=schema)
    store.create_schema()
    with psycopg.connect(dsn) as db:
        ids = store.enqueue_many_in(db, "jobs", [{"n": 1}, {"n": 2}])
        db.commit()
    return ids[1]


def test_a_read_only_admin_reads_with_usage_and_select_alone(
    postgres_dsn: str, postgres_schema: str, reader: str
) -> None:
    second = filled_schema(postgres_dsn, postgres_schema)
    grant_reading(postgres_dsn, postgres_schema, reader)
    store = tickler.PostgresStore(reader, schema=postgres_schema)
    admin = store.admin(read_only=True)
    read_everything(admin, "jobs", second)
    refuses_every_write(admin, "jobs", second)
    trio.run(admin.aclose)
    shows_every_page(store, "jobs", second)


def test_a_read_only_admin_creates_no_schema(postgres_dsn: str, postgres_schema: str) -> None:
    import psycopg

    admin = tickler.PostgresStore(postgres_dsn, schema=postgres_schema).admin(read_only=True)
    with pytest.raises(tickler.StoreError, match="has no tickler tables yet, and a read-only"):
        trio.run(admin.queues)
    trio.run(admin.aclose)
    with psycopg.connect(postgres_dsn) as db:
        found = db.execute(
            "SELECT 1 FROM pg_namespace WHERE nspname = %s", (postgres_schema,)
        ).fetchall()
    assert found == []


def test_a_read_only_admin_does_not_migrate_an_older_schema(
    postgres_dsn: str, postgres_schema: str
) -> None:
    import psycopg

    from tickler._stores import postgres as postgres_store

    filled_schema(postgres_dsn, postgres_schema)
    owners = f'"{postgres_schema}".tickler_owners'

    def columns() -> list[str]:
        with psycopg.connect(postgres_dsn) as db:
            return [
                str(row[0])
                for row in db.execute(
                    "SELECT column_name FROM information_schema.columns"
                    " WHERE table_schema = %s AND table_name = 'tickler_owners'"
                    " ORDER BY column_name",
                    (postgres_schema,),
                )
            ]

    with psycopg.connect(postgres_dsn, autocommit=True) as db:  # as version 7 had it
        db.execute(f"ALTER TABLE {owners} DROP COLUMN host, DROP pid, DROP backend_pid")
        db.execute(f'UPDATE "{postgres_schema}".tickler_schema SET version = 7')  # noqa: S608
    older = columns()
    admin = tickler.PostgresStore(postgres_dsn, schema=postgres_schema).admin(read_only=True)
    with pytest.raises(
        tickler.StoreError,
        match=rf"schema version 7; a read-only admin reads version {postgres_store.SCHEMA_VERSION}"
        " and migrates nothing",
    ):
        trio.run(admin.queues)
    trio.run(admin.aclose)
    with psycopg.connect(postgres_dsn) as db:
        version = db.execute(
            f'SELECT version FROM "{postgres_schema}".tickler_schema'  # noqa: S608
        ).fetchall()
    assert version == [(7,)]
    assert columns() == older == ["locked_at", "owner"]


@pytest.mark.parametrize("read_only", [False, True])
def test_the_admin_holds_one_connection(
    postgres_dsn: str, postgres_schema: str, read_only: bool
) -> None:
    """The admin's session runs no batch: no liveness connection beside its own."""
    import psycopg
    import psycopg.conninfo

    filled_schema(postgres_dsn, postgres_schema)
    name = f"tickler_admin_{uuid.uuid4().hex[:12]}"
    dsn = psycopg.conninfo.make_conninfo(postgres_dsn, application_name=name)
    admin = tickler.PostgresStore(dsn, schema=postgres_schema).admin(read_only=read_only)

    def connections() -> int:
        with psycopg.connect(postgres_dsn) as db:
            row = db.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (name,)
            ).fetchone()
        assert row is not None
        return int(row[0])

    assert trio.run(admin.queues) == ["jobs"]
    assert connections() == 1
    trio.run(admin.aclose)
    # (A backend leaves pg_stat_activity a moment after its client closed.)
    deadline = time.monotonic() + 10
    while connections():
        assert time.monotonic() < deadline, "the admin's connection stayed open after aclose()"
        time.sleep(0.01)
