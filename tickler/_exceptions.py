"""The exceptions tickler raises."""

from __future__ import annotations


class TicklerError(Exception):
    """Base class of the errors tickler raises on purpose."""


class QueueFull(TicklerError):
    """The service already holds ``max_queue_length`` queued requests."""


class ServiceClosed(TicklerError):
    """The service no longer accepts requests: a stop has begun or the run has ended."""

    _service: object = None  # the service that refused, when its queue did


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
