"""tickler.web: a dashboard for a store's queues, served as an ASGI application.

``app(store)`` returns a Starlette application that reads and acts through the
store's admin API (``store.admin()``): it sees every replica's work and needs
no running service. Mount it in your own Starlette application, or serve it
with ``serve(url)`` (``python -m tickler web URL``) on Hypercorn's Trio worker.

Needs the ``web`` extra: ``pip install 'trio-tickler[web]'``. The application
runs on Trio, as the admin API does.
"""

from __future__ import annotations

try:
    import hypercorn as _hypercorn  # noqa: F401 - checked here, imported where served
    import jinja2 as _jinja2  # noqa: F401
    import starlette as _starlette  # noqa: F401
except ImportError as _missing:  # pragma: no cover - the extra is installed in the tests
    raise ImportError(
        f"tickler.web needs the web extra ({_missing.name} is missing):"
        " pip install 'trio-tickler[web]'"
    ) from None

from ._app import Auth as Auth
from ._app import BasicAuth as BasicAuth
from ._app import app as app
from ._serve import serve as serve

__all__ = ["Auth", "BasicAuth", "app", "serve"]
