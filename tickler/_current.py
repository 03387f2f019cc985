"""Which attempt a task belongs to: the registry behind current_service() and current_ticket()."""

from __future__ import annotations

from typing import Any

import trio

from ._ticket import Ticket


class Attempt:
    """A processor's service, the request it is running (for current_ticket()) and its scope.

    ``withdrawn`` is the request whose attempt ``cancel()`` took away.
    """

    __slots__ = ("scope", "service", "ticket", "withdrawn")

    def __init__(self, service: Any, scope: trio.CancelScope | None) -> None:
        self.service = service  # a Service
        self.ticket: Ticket[Any, Any] | None = None
        self.scope = scope
        self.withdrawn: Ticket[Any, Any] | None = None


# Every running processor's task, in every Trio run of the process. A
# processor writes its running request to its entry as it starts each
# attempt: one attribute store, where a context variable set per attempt
# would allocate.
ATTEMPTS: dict[trio.lowlevel.Task, Attempt] = {}


def current_attempt(what: str) -> Attempt:
    """The attempt the calling task belongs to: its processor's, or its nearest ancestor's."""
    try:
        task: trio.lowlevel.Task | None = trio.lowlevel.current_task()
    except RuntimeError:
        task = None
    while task is not None:
        attempt = ATTEMPTS.get(task)
        if attempt is not None and attempt.ticket is not None:
            return attempt
        nursery = task.parent_nursery
        task = nursery.parent_task if nursery is not None else None
    raise RuntimeError(f"{what}() called outside a tickler handler")


def attempt_of_caller() -> Attempt | None:
    """The calling processor's own attempt entry (not an ancestor's), if it is one."""
    return ATTEMPTS.get(trio.lowlevel.current_task())
