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
