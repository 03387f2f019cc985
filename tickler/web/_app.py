"""The dashboard's ASGI application: pages and actions over a store's admin API."""

from __future__ import annotations

import functools
import inspect
import logging
import math
import pprint
import secrets
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import attrs
import jinja2
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from .._exceptions import KeyTaken
from .._stores._admin import COUNT_CAP, Admin
from .._stores.postgres import PostgresStore
from .._stores.sqlite import SqliteStore
from .._urls import redact

logger = logging.getLogger("tickler")

Auth = Callable[[Request], bool | Awaitable[bool]]
"""The user's own check: called with each HTTP request, before any page or action.

It returns (or, if async, resolves to) True to let the request through;
False answers 403 Forbidden. It runs on the server's Trio thread.
"""

_HERE = Path(__file__).parent
STATES = ("queued", "scheduled", "running", "retrying", "succeeded", "failed", "cancelled")
# The counts the overview shows, in order: the states, with "claimed" (running rows whose
# attempt has not started yet) beside "running", and "limited" (ready rows held by their
# group's limit).
COUNT_COLUMNS = (
    "queued",
    "scheduled",
    "limited",
    "claimed",
    "running",
    "retrying",
    "succeeded",
    "failed",
    "cancelled",
)
# The states each bulk action acts on: a filter outside them selects nothing.
BULK_STATES = {
    "cancel": ("queued", "scheduled", "running", "retrying"),
    "retry": ("failed", "cancelled"),
}
PAGE_SIZE = 50
CSRF_COOKIE = "tickler_csrf"
CSRF_FIELD = "csrf"
MAX_FORM_BYTES = 64 * 1024
REFRESH_SECONDS = 5
# What an action's redirect says on the page it lands on: fixed texts, never echoed input.
NOTICES = {
    "cancel": "Cancelled request #{n} (a running attempt is cancelled by its replica).",
    "cancel-refused": "Request #{n} was not cancelled: it is already final.",
    "retry": "Request #{n} is queued to run again now.",
    "retry-refused": (
        "Request #{n} was not retried: only a failed or cancelled request is, and only while"
        " no later request holds its key."
    ),
    "pause": "Paused: no replica starts a request of this queue until it is resumed.",
    "resume": "Resumed: the queue's replicas start requests again.",
    "bulk-cancel": "Cancelled {n} request(s).",
    "bulk-retry": "Queued {n} request(s) to run again now.",
    "bulk-retry-refused": (
        "Nothing was retried: a request of the key of one of them was enqueued while the"
        " retry ran. Try again: the requests whose key is taken are left as they are."
    ),
}
SECURITY_HEADERS = {
    # Every script and style is the package's own file: nothing inline can run.
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self';"
        " form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}


class Refused(Exception):
    """An HTTP error with a page of its own: status and a fixed message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@attrs.frozen
class BasicAuth:
    """An ``auth`` check for HTTP Basic authentication with one user and password.

    Both are compared in constant time (``secrets.compare_digest``). A refused
    request is answered 401 with a ``WWW-Authenticate`` challenge, so that a
    browser asks for them.
    """

    user: str
    password: str = attrs.field(repr=False)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.user, str) or not isinstance(self.password, str):
            raise TypeError("basic_auth must be a (user, password) pair of str")
        if not self.user or ":" in self.user:
            raise ValueError("basic_auth's user must be non-empty and hold no ':'")
        if not self.password:
            raise ValueError("basic_auth's password must be non-empty")

    def __call__(self, request: Request) -> bool:
        import base64
        import binascii

        scheme, _, encoded = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            user, _, password = base64.b64decode(encoded, validate=True).partition(b":")
        except (binascii.Error, ValueError):
            return False
        # Both comparisons run, whichever fails, so the time says nothing about which.
        user_ok = secrets.compare_digest(user, self.user.encode())
        password_ok = secrets.compare_digest(password, self.password.encode())
        return user_ok and password_ok


# -- formatting, as Jinja2 filters --------------------------------------------------------


def when(epoch: float | None) -> str:
    """An epoch time as UTC, to the second."""
    if epoch is None:
        return "—"
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def duration(seconds: float | None) -> str:
    """A number of seconds as a person reads it: 12 ms, 4.2 s, 3 min 5 s, 2 h 3 min."""
    if seconds is None or math.isnan(seconds):
        return "—"
    if seconds < 0:
        return "-" + duration(-seconds)
    if 0 < seconds < 0.0005:
        return "<1 ms"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60)} s"
    if seconds < 86400:
        return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60)} min"
    return f"{int(seconds // 86400)} d {int(seconds % 86400 // 3600)} h"


def relative(epoch: float | None, now: float) -> str:
    """How long ago (or from now) an epoch time is."""
    if epoch is None:
        return ""
    delta = now - epoch
    return f"{duration(delta)} ago" if delta >= 0 else f"in {duration(-delta)}"


def pretty(value: object) -> str:
    """A decoded request or result, pretty-printed (escaped by the template, as all text)."""
    return pprint.pformat(value, width=88, sort_dicts=False)


def number(count: int, estimated: bool = False) -> str:
    """A count with its thousands marked; an estimate (see QueueOverview.estimated) with
    ``~``, or ``+`` where it is only known to be past the exact count's cap."""
    if not estimated:
        return f"{count:,}"
    return f"{count:,}+" if count == COUNT_CAP else f"~{count:,}"


def short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _environment() -> jinja2.Environment:
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(_HERE / "templates"),
        autoescape=True,  # every piece of request content is escaped, in every template
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    environment.filters.update(
        when=when,
        duration=duration,
        pretty=pretty,
        short=short,
        relative=relative,
        number=number,
    )
    return environment


# -- the application ------------------------------------------------------------------------


@attrs.define(eq=False)
class Dashboard:
    """The state behind one ``app(...)``: the store, its admin object, the templates."""

    store: SqliteStore | PostgresStore
    read_only: bool
    auth: Auth | None
    environment: jinja2.Environment = attrs.field(factory=_environment)
    _admin: Admin | None = None

    @property
    def admin(self) -> Admin:
        # Opened on first use: a mounted application gets no lifespan events of its own.
        if self._admin is None:
            self._admin = self.store.admin(read_only=self.read_only)
        return self._admin

    async def aclose(self) -> None:
        if self._admin is not None:
            admin, self._admin = self._admin, None
            await admin.aclose()

    def secrets_of(self) -> list[str]:
        """What a message must not show: the store's DSN (its password)."""
        dsn = getattr(self.store, "dsn", None)
        return [dsn] if isinstance(dsn, str) else []

    def render(
        self, request: Request, template: str, status: int = 200, **context: Any
    ) -> HTMLResponse:
        token = request.cookies.get(CSRF_COOKIE) or ""
        fresh = not _good_token(token)
        if fresh:
            token = secrets.token_urlsafe(32)
        root = request.scope.get("root_path", "")
        notice = NOTICES.get(request.query_params.get("done", ""), "")
        count = request.query_params.get("n", "")
        html = self.environment.get_template(template).render(
            root=root,
            csrf=token,
            read_only=self.read_only,
            link=functools.partial(link, root),
            notice=notice.format(n=int(count)) if notice and count.isdigit() else "",
            now=time.time(),
            refresh=REFRESH_SECONDS,
            states=STATES,
            **context,
        )
        response = HTMLResponse(html, status_code=status, headers=SECURITY_HEADERS)
        if fresh:
            response.set_cookie(
                CSRF_COOKIE,
                token,
                path=root or "/",
                httponly=True,
                samesite="strict",
                secure=request.url.scheme == "https",
            )
        return response


def _good_token(token: str) -> bool:
    return 20 <= len(token) <= 100 and token.replace("-", "").replace("_", "").isalnum()


def link(root: str, page: str, **query: object) -> str:
    """The path of one of the dashboard's pages, under the mount point, with a query."""
    kept = {name: value for name, value in query.items() if value not in (None, "")}
    suffix = "?" + urllib.parse.urlencode(kept) if kept else ""
    return f"{root}/{page}{suffix}"


Endpoint = Callable[[Dashboard, Request], Awaitable[Response]]


def _page(dashboard: Dashboard, endpoint: Endpoint) -> Callable[[Request], Awaitable[Response]]:
    """An endpoint with the dashboard's error pages: an error's text never holds the DSN."""

    async def run(request: Request) -> Response:
        try:
            return await endpoint(dashboard, request)
        except Refused as refused:
            return dashboard.render(
                request, "error.html", status=refused.status, message=refused.message
            )
        except (TypeError, ValueError) as exc:
            # The admin API's word on a bad queue name or key: the rule, naming the field.
            message = redact(str(exc), dashboard.secrets_of())
            return dashboard.render(request, "error.html", status=400, message=message)
        except Exception as exc:
            hidden = dashboard.secrets_of()
            logger.error(  # noqa: TRY400 - the traceback is logged redacted, below
                "dashboard: %s %s failed:\n%s",
                request.method,
                request.url.path,
                redact(_traceback(exc), hidden),
            )
            message = redact(f"{type(exc).__name__}: {exc}", hidden)
            return dashboard.render(request, "error.html", status=500, message=message)

    return run


def _traceback(exc: BaseException) -> str:
    import traceback

    return "".join(traceback.format_exception(exc))


def _text(query: Mapping[str, str], name: str) -> str | None:
    value = query.get(name, "").strip()
    return value or None


def _int(query: Mapping[str, str], name: str) -> int | None:
    value = query.get(name, "").strip()
    if not value:
        return None
    if not value.isdigit() or len(value) > 19:
        raise Refused(400, f"{name} must be a whole number")
    return int(value)


def _filters(query: Mapping[str, str]) -> dict[str, str | None]:
    """The state, key and group filters of a query or form, checked."""
    state = _text(query, "state")
    if state is not None and state not in STATES:
        raise Refused(400, "state must be one of " + ", ".join(STATES))
    return {"state": state, "key": _text(query, "key"), "group": _text(query, "group")}


async def _queue(dashboard: Dashboard, query: Mapping[str, str]) -> tuple[str | None, list[str]]:
    """The queue a page shows (the first queue if none is named), and every queue."""
    queues = sorted(await dashboard.admin.queues())
    queue = _text(query, "queue")
    if queue is None:
        return (queues[0] if queues else None), queues
    return queue, queues


async def overview(dashboard: Dashboard, request: Request) -> Response:
    rows = sorted(await dashboard.admin.overview(), key=lambda row: row.queue)
    charts = {row.queue: _chart(row.per_minute) for row in rows}
    return dashboard.render(
        request, "overview.html", rows=rows, columns=COUNT_COLUMNS, charts=charts, cap=COUNT_CAP
    )


def _chart(per_minute: list[tuple[float, int, int]]) -> dict[str, Any]:
    """The bars of a queue's last hour, a minute each, the oldest first: succeeded above
    the line, failed below it, scaled to the busiest minute."""
    peak = max([max(ok, failed) for _, ok, failed in per_minute] + [1])
    bars = [
        {
            "x": index * 4,
            "ok": round(20 * ok / peak, 1),
            "failed": round(20 * failed / peak, 1),
            "title": f"{when(minute)[11:16]} UTC: {ok} succeeded, {failed} failed",
        }
        for index, (minute, ok, failed) in enumerate(per_minute[-60:])
    ]
    return {
        "bars": bars,
        "succeeded": sum(ok for _, ok, _ in per_minute),
        "failed": sum(failed for _, _, failed in per_minute),
        "peak": peak,
    }


async def requests_page(dashboard: Dashboard, request: Request) -> Response:
    query = request.query_params
    queue, queues = await _queue(dashboard, query)
    filters = _filters(query)
    after = _int(query, "after")
    page = None
    if queue is not None:
        page = await dashboard.admin.requests(queue, after=after, limit=PAGE_SIZE, **filters)
    return dashboard.render(
        request,
        "requests.html",
        queue=queue,
        queues=queues,
        filters=filters,
        after=after,
        page=page,
    )


async def detail(dashboard: Dashboard, request: Request) -> Response:
    query = request.query_params
    queue = _text(query, "queue")
    request_id = _int(query, "id")
    if queue is None or request_id is None:
        raise Refused(400, "a request is named by its queue and id")
    found = await dashboard.admin.lookup(queue, request_id)
    if found is None:
        raise Refused(404, "no such request (it may have passed its retention)")
    return dashboard.render(request, "detail.html", queue=queue, found=found)


async def replicas(dashboard: Dashboard, request: Request) -> Response:
    rows = await dashboard.admin.replicas()  # by host, then PID
    return dashboard.render(request, "replicas.html", rows=rows)


async def confirm(dashboard: Dashboard, request: Request) -> Response:
    """The confirmation of a bulk action: what the filter selects, and how many."""
    if dashboard.read_only:
        raise Refused(403, "this dashboard is read-only")
    query = request.query_params
    action = query.get("action", "")
    if action not in BULK_STATES:
        raise Refused(400, "action must be cancel or retry")
    queue = _text(query, "queue")
    if queue is None:
        raise Refused(400, "queue is required")
    filters = _filters(query)
    count = await _bulk_count(dashboard, action, queue, filters)
    return dashboard.render(
        request, "confirm.html", action=action, queue=queue, filters=filters, count=count
    )


async def _bulk_count(
    dashboard: Dashboard, action: str, queue: str, filters: dict[str, str | None]
) -> int:
    """How many rows the bulk ``action`` would change under ``filters``."""
    states = BULK_STATES[action]
    if filters["state"] is not None:
        states = (filters["state"],) if filters["state"] in states else ()
    total = 0
    for state in states:
        total += await dashboard.admin.count_where(
            queue, state=state, key=filters["key"], group=filters["group"]
        )
    return total


async def act(dashboard: Dashboard, request: Request) -> Response:
    """POST /act: one action, checked (read-only, CSRF), done, logged, then a redirect."""
    if dashboard.read_only:
        logger.warning("dashboard: refused a %s: read-only", request.url.path)
        raise Refused(403, "this dashboard is read-only")
    form = await _form(request)
    cookie = request.cookies.get(CSRF_COOKIE, "")
    token = form.get(CSRF_FIELD, "")
    if not (cookie and token and secrets.compare_digest(cookie.encode(), token.encode())):
        logger.warning("dashboard: refused an action without a valid CSRF token")
        raise Refused(403, "this form has expired or came from another site: reload and retry")
    action = form.get("action", "")
    queue = _text(form, "queue")
    if queue is None:
        raise Refused(400, "queue is required")
    admin = dashboard.admin
    root = request.scope.get("root_path", "")
    who = _who(request)
    if action in ("cancel", "retry"):
        request_id = _int(form, "id")
        if request_id is None:
            raise Refused(400, "id is required")
        done = await (admin.cancel if action == "cancel" else admin.retry)(queue, request_id)
        logger.info(
            "dashboard: %s of request %d of queue %r %s (by %s)",
            action,
            request_id,
            queue,
            "done" if done else "refused",
            who,
        )
        outcome = action if done else f"{action}-refused"
        return _redirect(
            link(root, "request", queue=queue, id=request_id, done=outcome, n=request_id)
        )
    if action in ("pause", "resume"):
        await (admin.pause if action == "pause" else admin.resume)(queue)
        logger.info("dashboard: %s of queue %r (by %s)", action, queue, who)
        return _redirect(link(root, "", done=action, n=0))
    if action in ("bulk-cancel", "bulk-retry"):
        filters = _filters(form)
        where = admin.cancel_where if action == "bulk-cancel" else admin.retry_where
        try:
            count = await where(queue, **filters)
        except KeyTaken:
            # A key enqueued meanwhile: the statement wrote nothing (see retry_where).
            logger.info(
                "dashboard: %s of queue %r refused: a key was taken meanwhile (by %s)",
                action,
                queue,
                who,
            )
            return _redirect(
                link(root, "requests", queue=queue, **filters, done=f"{action}-refused", n=0)
            )
        logger.info(
            "dashboard: %s of queue %r where %s: %d request(s) (by %s)",
            action,
            queue,
            {name: value for name, value in filters.items() if value is not None} or "all",
            count,
            who,
        )
        return _redirect(link(root, "requests", queue=queue, **filters, done=action, n=count))
    raise Refused(400, "unknown action")


def _who(request: Request) -> str:
    """Who acted, for the log: the client's address, and the Basic user if any."""
    client = request.client.host if request.client is not None else "unknown client"
    scheme, _, encoded = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "basic":
        import base64
        import binascii

        try:
            user = base64.b64decode(encoded, validate=True).partition(b":")[0]
        except (binascii.Error, ValueError):
            return client
        return f"{user.decode(errors='replace')!r} at {client}"
    return client


def _redirect(path: str) -> Response:
    return RedirectResponse(path, status_code=303, headers=SECURITY_HEADERS)


async def _form(request: Request) -> dict[str, str]:
    """The POSTed form (application/x-www-form-urlencoded, as the pages send it)."""
    content_type = request.headers.get("content-type", "").partition(";")[0].strip()
    if content_type != "application/x-www-form-urlencoded":
        raise Refused(415, "actions are posted as forms")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            raise Refused(413, "form too large")
    fields = urllib.parse.parse_qs(body.decode("utf-8", errors="replace"), max_num_fields=20)
    return {name: values[-1] for name, values in fields.items()}


@attrs.define(eq=False)
class _Guard:
    """Runs ``auth`` before anything else, static files included."""

    app: ASGIApp
    auth: Auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        allowed = self.auth(Request(scope, receive))
        if inspect.isawaitable(allowed):
            allowed = await allowed
        if allowed is True:
            await self.app(scope, receive, send)
            return
        if isinstance(self.auth, BasicAuth):
            headers = {"WWW-Authenticate": 'Basic realm="tickler", charset="UTF-8"'}
            refusal = PlainTextResponse("401 Unauthorized\n", 401, headers=headers)
        else:
            refusal = PlainTextResponse("403 Forbidden\n", 403)
        await refusal(scope, receive, send)


def app(
    store: SqliteStore | PostgresStore, *, read_only: bool = False, auth: Auth | None = None
) -> ASGIApp:
    """The dashboard of ``store``'s queues, as an ASGI application.

    Mount it in a Starlette application (``Mount("/tickler", app=tickler.web.app(store))``)
    or serve it with :func:`serve`. It runs on Trio. It reads and acts through
    ``store.admin()``, opened on the first request and closed at the
    application's shutdown where its lifespan runs.

    Args:
        store: a ``tickler.SqliteStore`` or ``tickler.PostgresStore``.
        read_only: show no actions, and refuse each with 403 Forbidden.
        auth: the user's own check, called with each ``starlette.requests.Request``
            before any page, action or file; it returns True (or an awaitable of
            True) to let it through, anything else answers 403 (401 with a Basic
            challenge for a :class:`BasicAuth`). None: no check, as for any page
            bound to 127.0.0.1 only.

    Raises:
        TypeError: ``store`` has no admin API, ``read_only`` is not a bool, or
            ``auth`` is not callable.
    """
    if not callable(getattr(store, "admin", None)):
        raise TypeError(
            "store must be a tickler store with an admin API (SqliteStore, PostgresStore)"
        )
    if not isinstance(read_only, bool):
        raise TypeError("read_only must be a bool")
    if auth is not None and not callable(auth):
        raise TypeError("auth must be a callable taking a request, or None")
    dashboard = Dashboard(store, read_only, auth)

    def route(path: str, endpoint: Endpoint, methods: tuple[str, ...] = ("GET",)) -> Route:
        return Route(path, _page(dashboard, endpoint), methods=list(methods))

    import contextlib

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await dashboard.aclose()

    application = Starlette(
        routes=[
            route("/", overview),
            route("/requests", requests_page),
            route("/request", detail),
            route("/replicas", replicas),
            route("/confirm", confirm),
            route("/act", act, ("POST",)),
            Mount("/static", app=StaticFiles(directory=_HERE / "static"), name="static"),
        ],
        lifespan=lifespan,
    )
    return application if auth is None else _Guard(application, auth)
