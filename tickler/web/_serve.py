"""Serve the dashboard on Hypercorn's Trio worker: ``python -m tickler web URL``."""

from __future__ import annotations

import logging
from typing import Any

import trio

from ._app import BasicAuth, _allowed_hosts, app

logger = logging.getLogger("tickler")


def serve(
    url: str,
    *,
    schema: str = "tickler",
    host: str = "127.0.0.1",
    port: int = 8000,
    read_only: bool = False,
    basic_auth: tuple[str, str] | None = None,
    allowed_hosts: list[str] | tuple[str, ...] = (),
) -> None:
    """Serve the dashboard of the store at ``url`` until interrupted (Ctrl-C or SIGTERM).

    Args:
        url: a ``sqlite:///`` URL or a PostgreSQL DSN, as ``python -m tickler inspect``
            takes. Its password is never shown.
        schema: with PostgreSQL, the schema of the store (as every command's
            ``--schema``).
        host: the address to bind: 127.0.0.1 (this machine only) unless told otherwise.
        port: the TCP port; 0 picks a free one.
        read_only: show no actions and refuse them.
        basic_auth: ``(user, password)`` to require HTTP Basic authentication.
        allowed_hosts: the host names (no port) the dashboard answers to besides this
            machine's own and the address each connection came in on, as :func:`app`
            takes them: a request with any other ``Host`` is refused with 400.

    Raises:
        TypeError, ValueError: a parameter breaks its rule (the message names it).
    """
    if not isinstance(url, str):
        raise TypeError("url must be a str")
    if not isinstance(schema, str):
        raise TypeError("schema must be a str")
    if not isinstance(host, str) or not host:
        raise TypeError("host must be a non-empty str")
    if isinstance(port, bool) or not isinstance(port, int):
        raise TypeError("port must be an int")
    if not 0 <= port <= 65535:
        raise ValueError("port must be from 0 to 65535")
    auth = None
    if basic_auth is not None:
        if not isinstance(basic_auth, tuple) or len(basic_auth) != 2:
            raise TypeError("basic_auth must be a (user, password) pair of str")
        auth = BasicAuth(*basic_auth)
    # Checked before the store is opened, as every other parameter.
    _allowed_hosts(allowed_hosts)
    import hypercorn.trio
    from hypercorn.config import Config

    from .._urls import open_store, redact

    store = open_store(url, schema=schema)
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    logger.info(
        "dashboard of %s on http://%s:%d%s",
        redact(url, [url]),
        host,
        port,
        " (read-only)" if read_only else "",
    )
    # Starlette's and Hypercorn's ASGI types differ in their spelling only.
    application: Any = app(store, read_only=read_only, auth=auth, allowed_hosts=allowed_hosts)
    trio.run(hypercorn.trio.serve, application, config)
