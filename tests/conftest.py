"""Shared helpers for tickler's tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
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
        + stats.in_flight
        + stats.retrying
        + stats.succeeded
        + stats.failed
        + stats.cancelled
    ), stats
