"""A request's receipt: its state, its timestamps and its outcome."""

from __future__ import annotations

import contextvars
import enum
from typing import Any

import attrs
import trio

from ._exceptions import RequestCancelled


class Status(enum.Enum):
    """Where a request is in its life. The last three are final."""

    QUEUED = "queued"
    RUNNING = "running"
    RETRYING = "retrying"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


FINAL = frozenset({Status.SUCCEEDED, Status.FAILED, Status.CANCELLED})


@attrs.define(eq=False, slots=True)
class Waiting:
    """What an unfinished ticket holds once somebody awaits it."""

    context: contextvars.Context
    event: trio.Event = attrs.Factory(trio.Event)


# A queued ticket is the main per-request cost of a queue of 100,000, so it
# carries exactly one private slot. Until the request is final it holds the
# enqueuer's Context (or a Waiting wrapping it); afterwards a
# (finished_at, result or exception) pair. Keeping `finished_at` there rather
# than in a slot of its own keeps a queued request under 160 bytes.
@attrs.define(eq=False, slots=True, weakref_slot=False)
class Ticket:
    """The receipt for one request handed to a :class:`tickler.Service`.

    A ticket moves QUEUED -> RUNNING (-> RETRYING -> RUNNING ...) and ends in
    exactly one of SUCCEEDED, FAILED or CANCELLED. Times come from
    :func:`trio.current_time`.
    """

    request: Any
    """The object passed to ``enqueue_request``."""
    id: int
    """Increasing number, unique within its service, starting at 1."""
    status: Status
    """The current state."""
    attempts: int
    """Attempts started so far."""
    enqueued_at: float | None
    """When the request was accepted (for requests enqueued before the run
    started: when the run started)."""
    started_at: float | None
    """When the latest attempt started, or None if none has."""
    _state: Any = attrs.field(repr=False, alias="_state")

    @property
    def finished_at(self) -> float | None:
        """When the request reached its final state, or None until then."""
        if self.status in FINAL:
            return self._state[0]  # type: ignore[no-any-return]
        return None

    @property
    def done(self) -> bool:
        """Whether the request has reached a final state."""
        return self.status in FINAL

    async def wait(self) -> Any:
        """Wait until the request is final and return the handler's result.

        Always a checkpoint.

        Raises:
            RequestCancelled: if the request ended CANCELLED.
            Exception: the handler's final exception if the request FAILED.
        """
        if self.status in FINAL:
            await trio.lowlevel.checkpoint()
        else:
            state = self._state
            if type(state) is not Waiting:
                state = Waiting(state)
                self._state = state
            await state.event.wait()
        return self.result()

    def result(self) -> Any:
        """Return the result of a final ticket, like :meth:`wait` without waiting.

        Raises:
            RuntimeError: if the request is not final yet.
        """
        status = self.status
        if status is Status.SUCCEEDED:
            return self._state[1]
        if status is Status.FAILED:
            raise self._state[1]
        if status is Status.CANCELLED:
            raise RequestCancelled(f"request #{self.id} was cancelled")
        raise RuntimeError(f"request #{self.id} is {status.value}, not final")

    def __repr__(self) -> str:
        return (
            f"<tickler.Ticket #{self.id} {self.status.value} attempts={self.attempts}"
            f" request={self.request!r}>"
        )
