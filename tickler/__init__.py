"""tickler: hand work to the background of a Trio service, bounded and accounted for.

The in-memory core is imported here. The stores and the admin API are imported on
first use of their names (``tickler.SqliteStore``, ``tickler.PostgresStore``,
``tickler.Admin``, ...), through the module's ``__getattr__``: a service that keeps
its requests in memory loads no SQL module, no ``sqlite3`` and no ``psycopg``.
"""

from importlib import import_module as _import_module
from importlib.metadata import version as _version
from typing import TYPE_CHECKING

from ._codec import Codec as Codec
from ._codec import JsonCodec as JsonCodec
from ._exceptions import QueueFull as QueueFull
from ._exceptions import RequestCancelled as RequestCancelled
from ._exceptions import RequestFailed as RequestFailed
from ._exceptions import ServiceClosed as ServiceClosed
from ._exceptions import StoreError as StoreError
from ._exceptions import TicklerError as TicklerError
from ._limits import Limit as Limit
from ._periodic import Periodic as Periodic
from ._retry import Retry as Retry
from ._service import Service as Service
from ._service import current_service as current_service
from ._service import current_ticket as current_ticket
from ._service import open_service as open_service
from ._statistics import TIME_BUCKETS as TIME_BUCKETS
from ._statistics import Histogram as Histogram
from ._statistics import ServiceStatistics as ServiceStatistics
from ._ticket import Status as Status
from ._ticket import Ticket as Ticket

if TYPE_CHECKING:
    from ._stores._admin import Admin as Admin
    from ._stores._admin import AdminPage as AdminPage
    from ._stores._admin import AdminRequest as AdminRequest
    from ._stores._admin import QueueOverview as QueueOverview
    from ._stores._admin import Replica as Replica
    from ._stores.postgres import PostgresStore as PostgresStore
    from ._stores.sqlite import SqliteStore as SqliteStore

# The names imported on first use, and the module of each.
_LAZY = {
    "Admin": "._stores._admin",
    "AdminPage": "._stores._admin",
    "AdminRequest": "._stores._admin",
    "QueueOverview": "._stores._admin",
    "Replica": "._stores._admin",
    "PostgresStore": "._stores.postgres",
    "SqliteStore": "._stores.sqlite",
}


if not TYPE_CHECKING:  # type checkers see the imports above, and no catch-all

    def __getattr__(name: str) -> object:
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module 'tickler' has no attribute {name!r}")
        value = getattr(_import_module(module, __name__), name)
        globals()[name] = value  # the next look finds it without this function
        return value

    def __dir__() -> list[str]:
        return sorted({*globals(), *_LAZY})


__all__ = [
    "TIME_BUCKETS",
    "Admin",
    "AdminPage",
    "AdminRequest",
    "Codec",
    "Histogram",
    "JsonCodec",
    "Limit",
    "Periodic",
    "PostgresStore",
    "QueueFull",
    "QueueOverview",
    "Replica",
    "RequestCancelled",
    "RequestFailed",
    "Retry",
    "Service",
    "ServiceClosed",
    "ServiceStatistics",
    "SqliteStore",
    "Status",
    "StoreError",
    "Ticket",
    "TicklerError",
    "current_service",
    "current_ticket",
    "open_service",
]

__version__ = _version("trio-tickler")
