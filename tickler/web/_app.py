"""The dashboard's ASGI application: pages and actions over a store's admin API."""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import inspect
import logging
import math
import pprint
import re
import secrets
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import attrs
import jinja2
from starlette.applications import Starlette
from starlette.datastructures import MutableHeaders
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import (
    FileResponse,
    HTMLResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
)
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .._core import MAX_ID  # the largest id (and count) a page takes
from .._exceptions import KeyTaken
from .._states import CLAIMED, COUNTED, FINAL, LIVE, READY, RETRYABLE, STATES
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
# The counts the overview shows, in order: statistics()'s (the states, with "claimed",
# running rows whose attempt has not started yet, beside "running"), and "limited" (ready
# rows held by their group's limit) before "claimed".
COUNT_COLUMNS = tuple(
    column for state in COUNTED for column in (("limited", state) if state == CLAIMED else (state,))
)
# The states each bulk action acts on: a filter outside them selects nothing.
BULK_STATES = {"cancel": LIVE, "retry": RETRYABLE}
PAGE_SIZE = 50
CSRF_COOKIE = "tickler_csrf"
CSRF_FIELD = "csrf"
MAX_FORM_BYTES = 64 * 1024
REFRESH_SECONDS = 5
# The host names every dashboard answers to, besides the address the connection came in
# on and the allowed_hosts of app(): this machine's own names.
LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]")
# The shortest secret= that app() takes, in bytes.
MIN_SECRET_BYTES = 16
FAVICON_TYPE = "image/vnd.microsoft.icon"
# What an action's redirect says on the page it lands on: fixed texts, never echoed input.
NOTICES = {
    "cancel": "Cancelled request #{n} before its next attempt started: no attempt of it runs.",
    "cancel-running": (
        "Asked the replica running request #{n} to stop its attempt: it becomes cancelled"
        " as the replica withdraws it (within its poll_interval)."
    ),
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
    """An epoch time as UTC, to the second; one past the calendar's years (a row written
    with a delay of centuries) as the bound it passes."""
    if epoch is None or math.isnan(epoch):
        return "—"
    try:
        return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, OSError, ValueError):
        return "after 9999-12-31" if epoch > 0 else "before 0001-01-01"


# Past this many seconds, a duration is shown as its bound (a time past the calendar's
# years is stored as any float).
LONGEST_SHOWN = 10_000 * 365 * 86400


def duration(seconds: float | None) -> str:
    """A number of seconds as a person reads it: 12 ms, 4.2 s, 3 min 5 s, 2 h 3 min."""
    if seconds is None or math.isnan(seconds):
        return "—"
    if seconds > LONGEST_SHOWN:
        return "over 10,000 years"
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
    # The named sets of states the templates test a row's state against.
    environment.globals.update(live=LIVE, ready=READY, final=FINAL, retryable=RETRYABLE)
    return environment


# -- the application ------------------------------------------------------------------------


@attrs.define(eq=False)
class Dashboard:
    """The state behind one ``app(...)``: the store, its admin object, the templates, and
    the secret that signs its forms' tokens."""

    store: SqliteStore | PostgresStore
    read_only: bool
    auth: Auth | None
    secret: bytes = attrs.field(repr=False)
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

    # The forms' tokens: a random nonce and its HMAC under the dashboard's secret (the
    # signed double-submit pattern). A cookie planted by another site (another port of the
    # host, a sibling subdomain) holds a token this dashboard did not sign: refused.

    def _mac(self, nonce: str) -> str:
        digest = hmac.new(self.secret, nonce.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

    def new_token(self) -> str:
        nonce = secrets.token_urlsafe(24)
        return f"{nonce}.{self._mac(nonce)}"

    def signed(self, token: str) -> bool:
        """Whether ``token`` is one this dashboard issued (compared in constant time)."""
        nonce, dot, mac = token.partition(".")
        if not dot or len(token) > 200 or not token.isascii():
            return False
        return hmac.compare_digest(mac.encode(), self._mac(nonce).encode())

    def render(
        self,
        request: Request,
        template: str,
        status: int = 200,
        notice: bool = True,
        **context: Any,
    ) -> HTMLResponse:
        """``template`` with ``context``; ``notice``: with the notice its query names (an
        error page shows none: its query may be what failed)."""
        token = request.cookies.get(CSRF_COOKIE) or ""
        fresh = not self.signed(token)
        if fresh:
            token = self.new_token()
        root = request.scope.get("root_path", "")
        html = self.environment.get_template(template).render(
            root=root,
            csrf=token,
            read_only=self.read_only,
            link=functools.partial(link, root),
            notice=_notice(request.query_params) if notice else "",
            now=time.time(),
            refresh=REFRESH_SECONDS,
            states=STATES,
            **context,
        )
        response = HTMLResponse(html, status_code=status)
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

    def error(self, request: Request, status: int, message: str) -> Response:
        """The error page; if even that fails to render, the message as plain text."""
        try:
            return self.render(request, "error.html", status=status, notice=False, message=message)
        except Exception:
            logger.exception("dashboard: the error page of %s failed", request.url.path)
            return PlainTextResponse(f"{status}: {message}\n", status)


def _notice(query: Mapping[str, str]) -> str:
    """The notice an action's redirect asks for (a fixed text), with its number."""
    done = _choice(query, "done", NOTICES)
    if done is None:
        return ""
    count = _int(query, "n")
    return NOTICES[done].format(n=0 if count is None else count)


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
            return dashboard.error(request, refused.status, refused.message)
        except (TypeError, ValueError) as exc:
            # The admin API's word on a bad queue name or key: the rule, naming the field.
            return dashboard.error(request, 400, redact(str(exc), dashboard.secrets_of()))
        except Exception as exc:
            hidden = dashboard.secrets_of()
            logger.error(  # noqa: TRY400 - the traceback is logged redacted, below
                "dashboard: %s %s failed:\n%s",
                request.method,
                request.url.path,
                redact(_traceback(exc), hidden),
            )
            message = redact(f"{type(exc).__name__}: {exc}", hidden)
            return dashboard.error(request, 500, message)

    return run


def _traceback(exc: BaseException) -> str:
    import traceback

    return "".join(traceback.format_exception(exc))


# -- the parameters of a query or form: each read by one of these, as given (nothing is
# stripped: the queue "mail " is not "mail"), an empty one as absent; a bad one is 400,
# naming it.


def _text(query: Mapping[str, str], name: str) -> str | None:
    return query.get(name) or None


def _int(query: Mapping[str, str], name: str) -> int | None:
    value = query.get(name) or None
    if value is None:
        return None
    # ASCII digits only: str.isdigit() takes "²", which int() refuses.
    if not (value.isascii() and value.isdigit()) or int(value) > MAX_ID:
        raise Refused(400, f"{name} must be a whole number from 0 to {MAX_ID}, not {short(value)}")
    return int(value)


def _choice(query: Mapping[str, str], name: str, choices: Iterable[str]) -> str | None:
    value = query.get(name) or None
    if value is not None and value not in choices:
        raise Refused(400, f"{name} must be one of " + ", ".join(choices))
    return value


def _filters(query: Mapping[str, str]) -> dict[str, str | None]:
    """The state, key and group filters of a query or form, checked."""
    state = _choice(query, "state", STATES)
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
    action = _choice(query, "action", BULK_STATES)
    if action is None:
        raise Refused(400, "action must be one of cancel, retry")
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
    """POST /act: one action, checked (read-only, origin, CSRF), done, logged, then a
    redirect."""
    if dashboard.read_only:
        logger.warning("dashboard: refused a %s: read-only", request.url.path)
        raise Refused(403, "this dashboard is read-only")
    foreign = _cross_site(request)
    if foreign is not None:
        logger.warning("dashboard: refused an action from another site (%s)", foreign)
        raise Refused(403, "this form came from another site")
    form = await _form(request)
    cookie = request.cookies.get(CSRF_COOKIE, "")
    token = form.get(CSRF_FIELD, "")
    if not (dashboard.signed(cookie) and secrets.compare_digest(cookie.encode(), token.encode())):
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
        running = False
        if action == "cancel":
            # What the notice says depends on whether an attempt ran, before or after.
            before = await admin.lookup(queue, request_id)
            done = await admin.cancel(queue, request_id)
            after = await admin.lookup(queue, request_id)
            running = any(seen is not None and seen.state == "running" for seen in (before, after))
        else:
            done = await admin.retry(queue, request_id)
        logger.info(
            "dashboard: %s of request %d of queue %r %s (by %s)",
            action,
            request_id,
            queue,
            "done" if done else "refused",
            who,
        )
        outcome = (f"{action}-running" if running else action) if done else f"{action}-refused"
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


def _cross_site(request: Request) -> str | None:
    """Why a POST came from another site, or None: a browser's ``Sec-Fetch-Site`` must be
    ``same-origin``, and its ``Origin`` the dashboard's own. A client that sends neither (not
    a browser: curl, a script) is let through to the token's check."""
    site = request.headers.get("sec-fetch-site")
    if site is not None and site != "same-origin":
        return f"Sec-Fetch-Site: {short(site, 40)}"
    origin = request.headers.get("origin")
    own = f"{request.url.scheme}://{request.headers.get('host', '')}"
    if origin is not None and origin.lower() != own.lower():
        return f"Origin: {short(origin, 80)}, not {own!r}"
    return None


def _redirect(path: str) -> Response:
    return RedirectResponse(path, status_code=303)


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


@attrs.define(eq=False)
class _Secured:
    """Every response carries SECURITY_HEADERS, whoever made it: a page, a file, a refusal,
    Starlette's own 404 or 500."""

    app: ASGIApp

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                headers = MutableHeaders(scope=message)
                for name, value in SECURITY_HEADERS.items():
                    headers.setdefault(name, value)
            await send(message)

        await self.app(scope, receive, sending)


# A Host header: a name or an IP literal, then a port.
_HOST_HEADER = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(?::[0-9]{1,5})?")


class _TrustedHost(TrustedHostMiddleware):
    """Starlette's check of the Host header against the allowed names (a page reached by
    another name, as by DNS rebinding, is refused with 400), which also lets through the
    address that the connection came in on (the server's own, as ``scope["server"]``):
    ``http://10.0.0.7:8000`` for a dashboard bound to 0.0.0.0."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _to_own_address(scope):
            await self.app(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def _to_own_address(scope: Scope) -> bool:
    server = scope.get("server")
    if not server or not isinstance(server[0], str) or not server[0]:
        return False
    address = f"[{server[0]}]" if ":" in server[0] else server[0]
    header = next((value for name, value in scope["headers"] if name == b"host"), b"")
    found = _HOST_HEADER.fullmatch(header.decode("latin-1"))
    return found is not None and found[1].lower() == address.lower()


def _allowed_hosts(allowed_hosts: object) -> list[str]:
    """LOCAL_HOSTS and ``allowed_hosts``, checked, an IPv6 address in brackets."""
    if isinstance(allowed_hosts, str) or not isinstance(allowed_hosts, list | tuple):
        raise TypeError("allowed_hosts must be a list (or tuple) of host names")
    hosts = list(LOCAL_HOSTS)
    for given in allowed_hosts:
        if not isinstance(given, str) or not given:
            raise TypeError("allowed_hosts must hold non-empty str host names")
        # An IPv6 address is written in brackets, as a Host header writes it.
        host = f"[{given}]" if ":" in given and not given.startswith("[") else given
        name = host[2:] if host.startswith("*.") else host
        if host != "*" and (_HOST_HEADER.fullmatch(name) is None or "*" in name):
            raise ValueError(
                f"allowed_hosts: {given!r} is not a host name: a name or address without"
                " a port, '*.example.com' for its subdomains, or '*' for any"
            )
        hosts.append(host.lower())
    return hosts


async def _favicon(_: Request) -> Response:
    """/favicon.ico, which a browser asks of a dashboard served at the root."""
    return FileResponse(_HERE / "static" / "favicon.ico", media_type=FAVICON_TYPE)


def app(
    store: SqliteStore | PostgresStore,
    *,
    read_only: bool = False,
    auth: Auth | None = None,
    allowed_hosts: list[str] | tuple[str, ...] = (),
    secret: str | bytes | None = None,
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
        allowed_hosts: the host names (no port) the dashboard answers to, besides
            ``localhost``, ``127.0.0.1``, ``[::1]`` and the address each connection came in
            on; ``"*.example.com"`` for its subdomains, ``"*"`` for any. A request with any
            other ``Host`` is refused with 400.
        secret: the key that signs the forms' CSRF tokens: at least 16 bytes (a str as its
            UTF-8). None: a random one for this application, so that a token outlives
            neither the process nor the application. Give every process serving one
            dashboard behind a single address the same secret.

    Raises:
        TypeError, ValueError: a parameter breaks its rule (the message names it).
    """
    if not callable(getattr(store, "admin", None)):
        raise TypeError(
            "store must be a tickler store with an admin API (SqliteStore, PostgresStore)"
        )
    if not isinstance(read_only, bool):
        raise TypeError("read_only must be a bool")
    if auth is not None and not callable(auth):
        raise TypeError("auth must be a callable taking a request, or None")
    hosts = _allowed_hosts(allowed_hosts)
    if isinstance(secret, str):
        secret = secret.encode()
    if secret is not None and not isinstance(secret, bytes):
        raise TypeError("secret must be a str, bytes or None")
    if secret is not None and len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"secret must be at least {MIN_SECRET_BYTES} bytes long")
    dashboard = Dashboard(store, read_only, auth, secret or secrets.token_bytes(32))

    def route(path: str, endpoint: Endpoint, methods: tuple[str, ...] = ("GET",)) -> Route:
        return Route(path, _page(dashboard, endpoint), methods=list(methods))

    import contextlib

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await dashboard.aclose()

    application: ASGIApp = Starlette(
        routes=[
            route("/", overview),
            route("/requests", requests_page),
            route("/request", detail),
            route("/replicas", replicas),
            route("/confirm", confirm),
            route("/act", act, ("POST",)),
            Route("/favicon.ico", _favicon),
            Mount("/static", app=StaticFiles(directory=_HERE / "static"), name="static"),
        ],
        lifespan=lifespan,
    )
    if auth is not None:
        application = _Guard(application, auth)
    return _Secured(_TrustedHost(application, allowed_hosts=hosts, www_redirect=False))
