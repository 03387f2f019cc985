"""A status-driven provisioning service on tickler.

``POST /sites`` records a status object and enqueues the site's first step in
the same transaction, then answers 202 Accepted; tickler moves the site from
``creating`` to ``running`` one idempotent, retried step at a time.
``DELETE /sites/{id}`` sets ``deleting`` and enqueues the delete workflow the
same way, and cancels the site's creation steps wherever they run. Too many
sites in progress answer 503 with Retry-After. ``GET /stats`` reports tickler's
statistics as JSON, ``GET /metrics`` in Prometheus's text format.

Run one replica with ``python -m examples.site_manager --data DIR --port 8000``,
or many with ``--postgres DSN`` added to each.
"""

from .app import Settings, make_app, serve

__all__ = ["Settings", "make_app", "serve"]
