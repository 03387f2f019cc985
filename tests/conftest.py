"""Shared helpers for tickler's tests."""

from __future__ import annotations

import contextvars
import functools
import uuid
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import attrs
import pytest
import trio

import tickler

from .store_backends import set_owner_suffix

# The process tests' checks live in a helper module: give its asserts
# pytest's explanations too.
pytest.register_assert_rewrite("tests.store_runs")


@attrs.define(eq=False)
class Recorder:
    """A handler that records what it runs and can be held at a gate."""

    gate: trio.Event | None = None
    running: int = 0
    max_running: int = 0
    seen: list[Any] = attrs.Factory(list)
    fail: Callable[[Any], bool] = lambda request: False

    async def __call__(self, request: Any) -> Any:
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        self.seen.append(request)
        try:
            if self.gate is not None:
                await self.gate.wait()
            else:
                await trio.lowlevel.checkpoint()
            if self.fail(request):
                raise ValueError(f"failed {request!r}")
            return ("done", request)
        finally:
            self.running -= 1


def check_identity(stats: tickler.ServiceStatistics) -> None:
    """Assert the counter identity every statistics snapshot must satisfy."""
    assert stats.enqueued == (
        stats.queued
        + stats.scheduled
        + stats.in_flight
        + stats.retrying
        + stats.succeeded
        + stats.failed
        + stats.cancelled
    ), stats


# The variables the test harness itself sets in every test task: pytest-trio's
# canary, and the decimal module's context (set by importing trio.testing).
HARNESS_VARIABLES = frozenset({"pytest-trio canary", "decimal_context"})


def run_without_harness_variables(fn: Callable[..., Any], *args: Any) -> Any:
    """Call ``fn`` in a new context holding the caller's variables minus the harness's.

    A test that sets no variable of its own thus calls ``fn`` with no
    contextvars at all, as a plain Trio service does.
    """
    context = contextvars.Context()
    for var, value in contextvars.copy_context().items():
        if var.name not in HARNESS_VARIABLES:
            context.run(var.set, value)
    return context.run(fn, *args)


@pytest.fixture(params=["harness contextvars", "no contextvars"])
def enqueue_context(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test twice: enqueueing as pytest-trio's tasks do, and with no contextvars.

    pytest-trio sets variables in every test task, so without this every
    request a test enqueues would carry a context, and the path a plain Trio
    service takes (and the benchmark measures) would go untested.
    """
    if request.param == "no contextvars":
        enqueue = tickler.Service.enqueue_request

        def enqueue_request(
            self: tickler.Service[Any, Any], request: Any, *args: Any, **options: Any
        ) -> tickler.Ticket[Any, Any]:
            call = functools.partial(enqueue, self, request, *args, **options)
            return run_without_harness_variables(call)  # type: ignore[no-any-return]

        monkeypatch.setattr(tickler.Service, "enqueue_request", enqueue_request)
    return str(request.param)


# -- PostgreSQL: TICKLER_TEST_POSTGRES, else a throwaway cluster, else skipped --
#
# TICKLER_REQUIRE_POSTGRES=1 (set by .ci/run) turns the skip into a failure.


def _without_postgres(reason: str) -> NoReturn:
    """Skip the test, loudly; or fail it where PostgreSQL is required."""
    import os

    reason = f"no PostgreSQL for the store tests: {reason}"
    if os.environ.get("TICKLER_REQUIRE_POSTGRES"):
        pytest.fail(f"{reason} (and TICKLER_REQUIRE_POSTGRES is set)", pytrace=False)
    pytest.skip(reason)


def _find_pg_ctl() -> str | None:
    """pg_ctl on PATH, else the newest in Debian's /usr/lib/postgresql/*/bin."""
    import glob
    import shutil

    found = shutil.which("pg_ctl")
    if found is not None:
        return found
    candidates = glob.glob("/usr/lib/postgresql/*/bin/pg_ctl")
    return max(candidates, key=lambda path: int(path.split("/")[4])) if candidates else None


class Cluster:
    """A PostgreSQL cluster of the tests' own, started by pytest-postgresql's executor.

    Its data, socket and log live in a temporary directory. As root, the
    binaries run as the ``postgres`` user (PostgreSQL refuses root), through
    a small pg_ctl wrapper handed to the executor, kept out of that user's reach.
    """

    def __init__(self, pg_ctl: str) -> None:
        import os
        import pwd
        import tempfile
        from pathlib import Path

        import port_for
        from pytest_postgresql.executors import PostgreSQLExecutor

        self.directory = Path(tempfile.mkdtemp(prefix="tickler-postgres-"))
        cluster = self.directory / "cluster"
        cluster.mkdir(mode=0o700)
        if os.geteuid() == 0:
            try:
                user = pwd.getpwnam("postgres")
            except KeyError:
                self.remove()
                _without_postgres("running as root, with no 'postgres' user to run pg_ctl as")
            self.directory.chmod(0o755)
            os.chown(cluster, user.pw_uid, user.pw_gid)
            wrapper = self.directory / "pg_ctl"
            wrapper.write_text(
                "#!/bin/sh\ncd /\nexec setpriv --reuid=postgres --regid=postgres --init-groups"
                f' -- "{pg_ctl}" "$@"\n'
            )
            wrapper.chmod(0o755)
            pg_ctl = str(wrapper)
        port = port_for.get_port(None)
        assert port is not None
        self.dsn = f"postgresql://postgres@127.0.0.1:{port}/postgres"
        self.executor = PostgreSQLExecutor(
            executable=pg_ctl,
            host="127.0.0.1",
            port=port,
            datadir=str(cluster / "data"),
            unixsocketdir=str(cluster),
            logfile=str(cluster / "server.log"),
            startparams="-w",
            dbname="postgres",
            user="postgres",
        )

    def start(self) -> None:
        """Start the server (initdb the first time); returns once it accepts connections."""
        self.executor.start()

    def stop(self) -> None:
        """Stop the server: ``pg_ctl stop -m fast`` ends every session."""
        launcher = self.executor.process
        self.executor.stop()
        if launcher is not None:
            # The launcher (pg_ctl start) ended long ago; close the pipes the executor
            # opened to it, which would otherwise be left to the garbage collector.
            for pipe in (launcher.stdin, launcher.stdout, launcher.stderr):
                if pipe is not None:
                    pipe.close()

    def remove(self) -> None:
        import shutil

        if getattr(self, "executor", None) is not None and self.executor.running():
            self.executor.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[Cluster]:
    """A throwaway cluster for the session, started from the local binaries.

    The tests that restart the server take this one, whatever TICKLER_TEST_POSTGRES says.
    """
    pg_ctl = _find_pg_ctl()
    if pg_ctl is None:
        _without_postgres(
            "TICKLER_TEST_POSTGRES is not set, and no pg_ctl to start a throwaway cluster"
            " (on PATH or in /usr/lib/postgresql/*/bin); install PostgreSQL's server"
            " binaries, or set TICKLER_TEST_POSTGRES to a DSN"
        )
    cluster = Cluster(pg_ctl)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.remove()


@pytest.fixture(scope="session")
def postgres_dsn(request: pytest.FixtureRequest) -> str:
    """A DSN of a real PostgreSQL server for the store tests.

    ``TICKLER_TEST_POSTGRES`` if set (a DSN that must connect); otherwise the
    session's throwaway cluster.
    """
    import os

    import psycopg

    dsn = os.environ.get("TICKLER_TEST_POSTGRES")
    if not dsn:
        cluster: Cluster = request.getfixturevalue("postgres_cluster")
        return cluster.dsn
    try:
        psycopg.connect(dsn, connect_timeout=10).close()
    except psycopg.Error as exc:
        pytest.fail(f"TICKLER_TEST_POSTGRES={dsn!r} cannot connect: {exc}", pytrace=False)
    return dsn


@pytest.fixture
def postgres_schema(postgres_dsn: str) -> Iterator[str]:
    """A fresh schema name for one test, dropped afterwards."""
    import uuid

    import psycopg

    schema = f"tickler_test_{uuid.uuid4().hex[:12]}"
    yield schema
    with psycopg.connect(postgres_dsn, autocommit=True) as connection:
        connection.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture
def cluster_schema(postgres_cluster: Cluster) -> Iterator[str]:
    """A fresh schema name on the throwaway cluster, for a test that restarts it."""
    import uuid

    import psycopg

    schema = f"tickler_test_{uuid.uuid4().hex[:12]}"
    yield schema
    if not postgres_cluster.executor.running():
        postgres_cluster.start()  # a test that failed with the server down
    with psycopg.connect(postgres_cluster.dsn, autocommit=True) as connection:
        connection.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture(autouse=True)
def _owner_ids_of_this_test() -> None:
    """Every owner id a test names (store_backends.owner_id) is its own: a suffix drawn
    for it, so that no other test, test run or leftover session shares its liveness lock."""
    set_owner_suffix(uuid.uuid4().hex[:12])
