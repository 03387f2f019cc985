"""The exceptions tickler raises."""

from __future__ import annotations


class TicklerError(Exception):
    """Base class of the errors tickler raises on purpose."""


class QueueFull(TicklerError):
    """The service already holds ``max_queue_length`` queued requests."""


class ServiceClosed(TicklerError):
    """The service no longer accepts requests: a stop has begun or the run has ended."""

    _service: object = None  # the service that refused, when its queue did


def queue_full(name: str, bound: int, held: int, asked: int) -> QueueFull:
    """The one refusal of a full queue, in memory or with a store, of one request or many:
    service ``name`` holds ``held`` of its ``max_queue_length`` ``bound`` and was asked
    for ``asked`` more."""
    return QueueFull(
        f"service {name!r} has room for {max(bound - held, 0)} more requests, not {asked}"
        f" (max_queue_length {bound}); none was enqueued"
    )


def service_closed(name: str, service: object = None) -> ServiceClosed:
    """The one refusal of a closed service ``name``: a stop has begun, or the run ended.

    ``service`` is the service whose own stop refused an enqueue (see
    Outcomes.refused_by_stop), or None."""
    closed = ServiceClosed(f"service {name!r} is closed")
    closed._service = service
    return closed


class RequestCancelled(TicklerError):
    """The request was cancelled before it could complete."""


class StoreError(TicklerError):
    """A store cannot be used: not a database, a foreign schema, a file that cannot be opened."""


class KeyTaken(StoreError):
    """An admin's retry_where() met a request of a key enqueued while it ran: it wrote
    nothing, and may be tried again."""


class RequestFailed(TicklerError):
    """A request's failure as the store keeps it: as text, from whichever process ran it.

    Attributes:
        error_type: the name of the exception's type.
        error_message: its message.
        error_traceback: its traceback, as text.
    """

    def __init__(self, error_type: str, error_message: str, error_traceback: str) -> None:
        super().__init__(f"{error_type}: {error_message}")
        self.error_type = error_type
        self.error_message = error_message
        self.error_traceback = error_traceback


class Withdrawn(Exception):
    """Raised in place of an attempt the store's loop took away: cancelled, handed back or lost.

    Private: it never reaches a caller, only the store's record of the attempt.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
