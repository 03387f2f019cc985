"""Shared helpers for tickler's tests."""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from typing import Any

import attrs
import pytest
import trio

import tickler

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


# -- PostgreSQL: the machine's server if one runs, else a throwaway cluster ----

LOCAL_POSTGRES = "postgresql://postgres@127.0.0.1:5432/postgres"


def _local_postgres_runs() -> bool:
    import os

    import psycopg

    if os.environ.get("TICKLER_TEST_THROWAWAY_POSTGRES"):  # to try the fallback here
        return False
    try:
        psycopg.connect(LOCAL_POSTGRES, connect_timeout=2).close()
    except psycopg.OperationalError:
        return False
    return True


@pytest.fixture(scope="session")
def postgres_dsn(request: pytest.FixtureRequest) -> str:
    """A DSN of a real PostgreSQL server for the store tests.

    The server on 127.0.0.1:5432 when one runs; otherwise a cluster that
    pytest-postgresql starts from the local binaries (pg_ctl) for the session.
    """
    if _local_postgres_runs():
        return LOCAL_POSTGRES
    proc = request.getfixturevalue("postgresql_proc")
    return f"postgresql://{proc.user}@{proc.host}:{proc.port}/{proc.dbname}"


@pytest.fixture
def postgres_schema(postgres_dsn: str) -> Any:
    """A fresh schema name for one test, dropped afterwards."""
    import uuid

    import psycopg

    schema = f"tickler_test_{uuid.uuid4().hex[:12]}"
    yield schema
    with psycopg.connect(postgres_dsn, autocommit=True) as connection:
        connection.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
