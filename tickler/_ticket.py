"""A request's receipt: its state, its timestamps and its outcome."""

from __future__ import annotations

import contextvars
from typing import Any, Generic, TypeVar

import attrs
import trio

from ._exceptions import RequestCancelled
from ._states import FINAL_STATUSES
from ._states import Status as Status

RequestT = TypeVar("RequestT")
ResultT = TypeVar("ResultT")

# The final statuses (see tickler/_states.py).
FINAL = FINAL_STATUSES


@attrs.define(eq=False, slots=True)
class Waiting:
    """What an unfinished ticket holds once somebody awaits it.

    ``token`` is the Trio run the waiters wait in. The service sets ``event``
    directly when that is its own run. Otherwise it marks the waiting
    ``foreign`` and sets the event from inside the waiters' run, so that they
    get an error rather than the service a crash.
    """

    context: contextvars.Context
    token: trio.lowlevel.TrioToken
    following: Waiting | None = None
    """Waiters of the same ticket in other runs."""
    event: trio.Event = attrs.Factory(trio.Event)
    foreign: bool = False


def _wrong_run(ticket_id: int) -> RuntimeError:
    return RuntimeError(
        f"Ticket.wait() for request #{ticket_id} called from a different trio.run than the one"
        " running its service; wait in the service's run (for example through"
        " trio.from_thread.run), or call result() once the ticket is done"
    )


# tuned (bench: memory per queued request): a queued ticket is the main per-request cost of a queue
# of 100,000, so it carries exactly one private slot. Until the request is final it holds the
# enqueuer's Context (or a Waiting wrapping it); afterwards a tuple starting with finished_at:
# (finished_at, result) for a success, (finished_at, None) for a cancel, and (finished_at,
# exception, its original traceback, its own __context__) for a failure, so that raising the
# exception again neither grows its traceback nor chains the caller's error. Keeping `finished_at`
# there rather than in a slot of its own keeps a queued request within 160 bytes.
@attrs.define(eq=False, slots=True, weakref_slot=False)
class Ticket(Generic[RequestT, ResultT]):
    """The receipt for one request handed to a :class:`tickler.Service`.

    A ticket moves QUEUED (or SCHEDULED, when enqueued with a delay) ->
    RUNNING (-> RETRYING -> RUNNING ...) and ends in
    exactly one of SUCCEEDED, FAILED or CANCELLED. Times come from
    :func:`trio.current_time`.
    """

    request: RequestT
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

    async def wait(self) -> ResultT:
        """Wait until the request is final and return the handler's result.

        Always a checkpoint. Call it from the Trio run that runs the service
        (a ticket that is already final can be awaited from any run).

        Raises:
            RequestCancelled: if the request ended CANCELLED.
            Exception: the handler's final exception if the request FAILED.
            RuntimeError: if the request became final while waited for from
                a different ``trio.run`` than the service's; raised when it
                does, and the service is not affected.
        """
        token = trio.lowlevel.current_trio_token()
        if self.status in FINAL:
            await trio.lowlevel.checkpoint()
        else:
            state = self._state
            if type(state) is Waiting:
                waiting: Waiting | None = state
                while waiting is not None and waiting.token is not token:
                    waiting = waiting.following
                if waiting is None:
                    waiting = Waiting(state.context, token, state)
                    self._state = waiting
            else:
                waiting = Waiting(state, token)
                self._state = waiting
            state = waiting
            await state.event.wait()
            if state.foreign:
                raise _wrong_run(self.id)
        try:
            return self.result()
        finally:
            del self  # as in result(): no cycle through a failure's traceback

    def result(self) -> ResultT:
        """Return the result of a final ticket, like :meth:`wait` without waiting.

        Raises:
            RuntimeError: if the request is not final yet.
        """
        status = self.status
        if status is Status.SUCCEEDED:
            return self._state[1]  # type: ignore[no-any-return]
        if status is Status.FAILED:
            _, error, traceback, context = self._state
            try:
                # Raised with its original traceback every time: raising the
                # same exception again would otherwise add frames to it.
                raise error.with_traceback(traceback)  # noqa: TRY301 - re-raised just below
            except BaseException:
                # Raising sets __context__ to whatever the caller is handling;
                # the stored exception keeps its own, and the caller's
                # exception (and its frames) do not live on in the ticket.
                error.__context__ = context
                raise
            finally:
                # This frame is in the traceback of the exception it raises;
                # keeping the ticket here would be a cycle through the ticket.
                del self, error, traceback, context
        if status is Status.CANCELLED:
            raise RequestCancelled(f"request #{self.id} was cancelled")
        raise RuntimeError(f"request #{self.id} is {status.value}, not final")

    def __repr__(self) -> str:
        return (
            f"<tickler.Ticket #{self.id} {self.status.value} attempts={self.attempts}"
            f" request={self.request!r}>"
        )
