"""A status-driven provisioning service on tickler.

``POST /sites`` records a status object and answers 202 Accepted; tickler then
moves the site from ``creating`` to ``running`` one idempotent, retried step at
a time. ``DELETE /sites/{id}`` sets ``deleting`` and a delete workflow removes
what the creation made. A full queue answers 503 with Retry-After.

Run it with ``python -m examples.site_manager --data DIR --port 8000``.
"""

from .app import Settings, make_app, serve

__all__ = ["Settings", "make_app", "serve"]
