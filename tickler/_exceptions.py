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
