"""tickler.web in a real browser: headless Chromium through Playwright, on a real server.

Each store (a SQLite file, a PostgreSQL schema) is filled by a real service in a
process of its own, which then keeps running the queue beside a second one. The
dashboard is served by Hypercorn on a free port, in a thread of the test, and a
person's clicks are played: the overview, a failed request and its traceback,
retry, cancel, pause and resume, the bulk actions, read-only mode, escaping.

Screenshots of every page are saved under TICKLER_ARTIFACTS (a directory) if set,
else under the test's tmp_path. This file is also the services' script:
``python -m tests.test_web worker ...``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import queue as queues
import re
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import pytest
import trio

import tickler
import tickler.web

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Dialog, Page

ROOT = Path(__file__).parent.parent
CHROMIUM = "/usr/bin/chromium"
QUEUE = "mail"
POLL = 0.05
SCRIPT = "<script>document.title='pwned';alert('pwned')</script>"


class Flaky(Exception):
    """Retried (after an hour): leaves its request RETRYING."""


# -- the services' side: python -m tests.test_web worker KIND TARGET SCHEMA FLAG [--fill] --


def make_store(kind: str, target: str, schema: str) -> tickler.SqliteStore | tickler.PostgresStore:
    if kind == "sqlite":
        return tickler.SqliteStore(target, poll_interval=POLL, lease=6)
    return tickler.PostgresStore(target, schema=schema, poll_interval=POLL, lease=6)


async def handle(flag: Path, request: dict[str, Any]) -> object:
    """What each request does, by its "do": succeed, fail until ``flag`` exists, stay
    retrying, or run until cancelled."""
    do = request["do"]
    if do == "fail":
        if not flag.exists():
            raise ValueError(f"the mail server refused {request['to']!r}")
        return "delivered on retry"
    if do == "flaky":
        raise Flaky("try again later")
    if do == "sleep":
        await trio.sleep_forever()
    await trio.sleep(0.01)
    return {"sent": request.get("to")}


# Every request of the fill, by its key: (request, enqueue options, its state once filled).
FILL: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {
    "order-7": ({"do": "ok", "to": "ada@example.com"}, {"priority": 5, "group": "eu"}, "succeeded"),
    "order-8": ({"do": "ok", "to": "grace@example.com"}, {}, "succeeded"),
    "script": ({"do": "ok", "to": SCRIPT}, {}, "succeeded"),
    "refused": ({"do": "fail", "to": "nobody@example.com"}, {}, "failed"),
    "flaky": ({"do": "flaky"}, {}, "retrying"),
    "later": ({"do": "ok", "to": "later@example.com"}, {"delay": 3600}, "scheduled"),
    "cancel-me": ({"do": "ok", "to": "gone@example.com"}, {"delay": 3600}, "cancelled"),
    "long": ({"do": "sleep"}, {}, "running"),
}
EXPECTED_COUNTS = {
    "queued": 0,
    "scheduled": 1,
    "claimed": 0,
    "running": 1,
    "retrying": 1,
    "succeeded": 3,
    "failed": 1,
    "cancelled": 1,
}


async def fill(service: tickler.Service[Any, Any], admin: Any) -> None:
    for key, (request, options, _) in FILL.items():
        service.enqueue_request(request, key=key, **options)
    await service.cancel("cancel-me")
    with trio.fail_after(20):
        while True:
            states = {key: await admin.lookup(QUEUE, key) for key in FILL}
            if all(
                found is not None
                and found.state == FILL[key][2]
                and (found.state != "running" or found.started_at is not None)
                for key, found in states.items()
            ):
                return
            await trio.sleep(POLL)


async def work(kind: str, target: str, schema: str, flag: str, filling: bool) -> None:
    store = make_store(kind, target, schema)
    retry = tickler.Retry(attempts=3, initial=3600, jitter=False, on=(Flaky,))
    async with tickler.open_service(
        functools.partial(handle, Path(flag)), store=store, name=QUEUE, capacity=4, retry=retry
    ) as service:
        if filling:
            admin = store.admin()
            await fill(service, admin)
            await admin.aclose()
        print("ready", flush=True)
        await trio.sleep_forever()


# -- the test's side ----------------------------------------------------------------------


@attrs.frozen
class Target:
    """A store, as the workers open it (kind, target, schema) and as the dashboard does."""

    kind: str
    target: str
    schema: str
    dashboard_store: tickler.SqliteStore | tickler.PostgresStore
    secret: str | None = None
    """A password in the dashboard's DSN, which no page or log line may show."""


@contextlib.contextmanager
def workers(target: Target, flag: Path, count: int) -> Iterator[list[subprocess.Popen[str]]]:
    """``count`` service processes on the queue; the first fills it. Killed at the end."""
    started = []
    try:
        for number in range(count):
            command = [sys.executable, "-m", "tests.test_web", "worker"]
            command += [target.kind, target.target, target.schema, str(flag)]
            started.append(
                subprocess.Popen(  # noqa: S603 - our own interpreter and script
                    [*command, *(["--fill"] if number == 0 else [])],
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        for process in started:
            assert process.stdout is not None
            line = process.stdout.readline()
            assert line == "ready\n", f"a worker ended early ({process.wait()})"
        yield started
    finally:
        for process in started:
            process.kill()
            process.wait()
            assert process.stdout is not None
            process.stdout.close()


@contextlib.contextmanager
def served(application: Any, host: str = "127.0.0.1") -> Iterator[str]:
    """``application`` on Hypercorn's Trio worker, on a free port of ``host``: its URL."""
    import hypercorn.trio
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"{host}:0"]
    config.accesslog = None
    config.graceful_timeout = 0.5
    found: queues.Queue[tuple[str, Any] | BaseException] = queues.Queue()

    async def main() -> None:
        stop = trio.Event()
        try:
            async with trio.open_nursery() as nursery:
                serving = functools.partial(
                    hypercorn.trio.serve, application, config, shutdown_trigger=stop.wait
                )
                binds = await nursery.start(serving)
                found.put((binds[0], (trio.lowlevel.current_trio_token(), stop)))
        except BaseException as exc:
            found.put(exc)
            raise

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    started = found.get(timeout=20)
    if isinstance(started, BaseException):
        raise started
    url, (token, stop) = started
    try:
        yield url
    finally:
        trio.from_thread.run_sync(stop.set, trio_token=token)
        thread.join(20)
        assert not thread.is_alive()


def call(admin: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    """One admin call, from the test's (synchronous) side."""
    return trio.run(functools.partial(getattr(admin, method), *args, **kwargs))


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not Path(CHROMIUM).exists():
        reason = f"no {CHROMIUM} for the browser tests: apt-get install -y chromium"
        if os.environ.get("TICKLER_REQUIRE_BROWSER"):
            pytest.fail(f"{reason} (and TICKLER_REQUIRE_BROWSER is set)", pytrace=False)
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
        )
        yield launched
        launched.close()


@pytest.fixture
def artifacts(tmp_path: Path) -> Path:
    directory = Path(os.environ.get("TICKLER_ARTIFACTS") or tmp_path / "artifacts")
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def with_password(dsn: str, password: str) -> str:
    """``dsn`` (a URL) with ``password`` for its user: a trust server ignores it."""
    parts = urllib.parse.urlsplit(dsn)
    user = parts.username or "postgres"
    netloc = f"{user}:{password}@{parts.hostname}:{parts.port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


@pytest.fixture(params=["sqlite", "postgres"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    if request.param == "sqlite":
        path = str(tmp_path / "queue.db")
        return Target("sqlite", path, "", tickler.SqliteStore(path, poll_interval=POLL, lease=6))
    dsn: str = request.getfixturevalue("postgres_dsn")
    schema: str = request.getfixturevalue("postgres_schema")
    secret = urllib.parse.urlsplit(dsn).password
    if secret is None:
        secret = "Tr0ub4dor-and-3"  # noqa: S105 - a password the trust server ignores
        dsn = with_password(dsn, secret)
    store = tickler.PostgresStore(dsn, schema=schema, poll_interval=POLL, lease=6)
    return Target("postgres", dsn, schema, store, secret)


def cells(page: Page, selector: str) -> dict[str, str]:
    """The overview's cells of the queue's row, by their data attribute."""
    row = page.locator(f"[data-queue='{QUEUE}']")
    return {
        name: row.locator(f"[{selector}='{name}']").inner_text().strip()
        for name in row.locator(f"[{selector}]").evaluate_all(
            f"cells => cells.map(cell => cell.getAttribute('{selector}'))"
        )
    }


def until(check: Callable[[], bool], page: Page, timeout: float = 10.0) -> None:
    """Reload ``page`` until ``check()`` holds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not reached on {page.url}"
        time.sleep(POLL)
        page.reload()


def test_dashboard_in_a_browser(
    browser: Browser,
    target: Target,
    tmp_path: Path,
    artifacts: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A person's session: counts, a failure's traceback, retry, cancel, pause, bulk."""
    caplog.set_level("INFO", logger="tickler")
    flag = tmp_path / "mail-server-fixed"
    admin = target.dashboard_store.admin()
    shown: list[str] = []  # every page's HTML, checked for the password at the end
    dialogs: list[str] = []
    shots = 0

    def shot(page: Page, name: str) -> None:
        nonlocal shots
        shots += 1
        shown.append(page.content())
        page.screenshot(path=artifacts / f"{target.kind}-{shots:02}-{name}.png", full_page=True)

    application = tickler.web.app(target.dashboard_store)
    with workers(target, flag, 2), served(application) as url:
        context = browser.new_context(viewport={"width": 1360, "height": 900})
        page = context.new_page()

        def on_dialog(dialog: Dialog) -> None:
            dialogs.append(dialog.message)
            dialog.dismiss()

        page.on("dialog", on_dialog)

        # The overview: each count as the store has it, and as the fill left it.
        page.goto(url + "/")
        counts = cells(page, "data-count")
        stored = call(admin, "counts", QUEUE)
        for state, expected in EXPECTED_COUNTS.items():
            assert counts[state] == str(stored[state]) == str(expected), state
        fields = cells(page, "data-field")
        assert fields["running"] == "1"
        assert fields["paused"] == "active"
        assert fields["oldest"] == "—"  # nothing is queued
        assert (
            "3 succeeded" in page.locator(f"[data-queue='{QUEUE}'] [data-field=hour]").inner_text()
        )
        shot(page, "overview")

        # The replicas: the owner of the running request holds its lease, renewed lately.
        long = call(admin, "lookup", QUEUE, "long")
        page.click("text=Replicas")
        replica = page.locator(f"tr[data-owner='{long.owner}']")
        assert replica.locator("td.num").inner_text() == "1"
        # (Renewed every third of 6 s, and a margin.)
        renewed = replica.locator("td[data-field=renewed]").inner_text()
        value, unit, ago = renewed.split()
        assert (ago, unit in ("ms", "s")) == ("ago", True), renewed
        assert float(value) / (1000 if unit == "ms" else 1) <= 4, renewed
        shot(page, "replicas")

        # The failed requests, by the filter form; one of them, with its traceback.
        page.click("nav >> text=Requests")
        page.select_option("select[name=state]", "failed")
        page.click("text=Filter")
        rows = page.locator("table.requests tbody tr")
        assert rows.evaluate_all("rows => rows.map(row => row.dataset.state)") == ["failed"]
        refused = call(admin, "lookup", QUEUE, "refused")
        shot(page, "requests-failed")
        page.click(f"text=#{refused.id}")
        assert page.locator("#state").inner_text() == "failed"
        traceback = page.locator("#traceback").inner_text()
        assert "Traceback (most recent call last)" in traceback
        assert "ValueError: the mail server refused 'nobody@example.com'" in traceback
        assert "in handle" in traceback
        shot(page, "detail-failed")

        # The mail server is fixed: retry, and watch the request succeed.
        flag.touch()
        page.click("button:has-text('Retry now')")
        assert "queued to run again now" in page.locator(".notice").inner_text()
        until(lambda: page.locator("#state").inner_text() == "succeeded", page)
        assert "delivered on retry" in page.locator("#result").inner_text()
        assert page.locator("#attempts").inner_text() == "2"
        shot(page, "detail-retried")

        # Cancel the running request: its replica withdraws the attempt.
        page.goto(url + f"/request?queue={QUEUE}&id={long.id}")
        assert page.locator("#state").inner_text() == "running"
        page.click("button:has-text('Cancel')")
        assert (
            page.locator(".notice")
            .inner_text()
            .startswith(f"Asked the replica running request #{long.id} to stop its attempt")
        )
        until(lambda: page.locator("#state").inner_text() == "cancelled", page)
        assert page.locator("#due").inner_text() == "— (final)"
        shot(page, "detail-cancelled")

        # Pause: the two services start nothing more, until resumed.
        page.click("text=Overview")
        page.click(f"[data-queue='{QUEUE}'] button:has-text('Pause')")
        assert cells(page, "data-field")["paused"] == "paused"
        enqueue(target, [{"do": "ok", "to": f"paused{n}@example.com"} for n in range(3)])
        time.sleep(10 * POLL)  # ten looks at the store by each service
        page.reload()
        assert cells(page, "data-count")["queued"] == "3"
        assert cells(page, "data-field")["oldest"] != "—"
        shot(page, "overview-paused")
        page.click(f"[data-queue='{QUEUE}'] button:has-text('Resume')")
        until(lambda: cells(page, "data-count")["succeeded"] == "7", page)
        assert cells(page, "data-count")["queued"] == "0"

        # Bulk: cancel what is scheduled, after a confirmation that counts it.
        page.goto(url + f"/requests?queue={QUEUE}&state=scheduled")
        page.click("text=Cancel all that match")
        assert page.locator("#count").inner_text() == "1"
        shot(page, "confirm-bulk-cancel")
        page.click("button.danger")
        assert page.locator(".notice").inner_text() == "Cancelled 1 request(s)."
        assert call(admin, "counts", QUEUE)["scheduled"] == 0
        # Bulk retry by key: the request cancelled at the fill runs, and succeeds.
        page.goto(url + f"/requests?queue={QUEUE}&key=cancel-me")
        page.click("text=Retry all that match")
        assert page.locator("#count").inner_text() == "1"
        page.click("button.danger")
        assert page.locator(".notice").inner_text() == "Queued 1 request(s) to run again now."
        gone = call(admin, "lookup", QUEUE, "cancel-me")
        page.goto(url + f"/request?queue={QUEUE}&id={gone.id}")
        until(lambda: page.locator("#state").inner_text() == "succeeded", page)

        # The <script> request is text: shown as typed, never run.
        script = call(admin, "lookup", QUEUE, "script")
        page.goto(url + f"/request?queue={QUEUE}&id={script.id}")
        assert SCRIPT in page.locator("#request").inner_text()
        assert SCRIPT in page.locator("#result").inner_text()
        shot(page, "detail-script")
        page.goto(url + f"/requests?queue={QUEUE}")
        assert "<script>" in page.locator(f"tr[data-id='{script.id}']").inner_text()
        assert page.title() != "pwned"
        assert dialogs == []

        # Read-only, beside it: the same pages without a button, and a forged POST refused.
        with served(tickler.web.app(target.dashboard_store, read_only=True)) as read_only:
            cancelled = call(admin, "lookup", QUEUE, "long")
            for path in ["/", f"/requests?queue={QUEUE}", f"/request?queue={QUEUE}&id={long.id}"]:
                page.goto(read_only + path)
                assert page.locator("form[method=post]").count() == 0
                assert page.locator("button[name=action], a.button").count() == 0
                assert page.locator("text=Cancel all that match").count() == 0
                assert page.locator("header .mode").inner_text() == "read-only"
            shot(page, "read-only-detail")
            forged = forge(read_only, {"action": "retry", "queue": QUEUE, "id": str(long.id)})
            assert forged.status_code == 403
            assert "read-only" in forged.text
            assert forge(read_only + "/confirm?action=retry&queue=mail").status_code == 403
            assert call(admin, "lookup", QUEUE, "long") == cancelled
        context.close()

    call(admin, "aclose")
    logged = [r.getMessage() for r in caplog.records if r.name == "tickler"]
    assert f"dashboard: retry of request {refused.id} of queue 'mail' done (by 127.0.0.1)" in logged
    assert f"dashboard: cancel of request {long.id} of queue 'mail' done (by 127.0.0.1)" in logged
    assert "dashboard: pause of queue 'mail' (by 127.0.0.1)" in logged
    assert "dashboard: resume of queue 'mail' (by 127.0.0.1)" in logged
    assert any(m.startswith("dashboard: bulk-cancel of queue 'mail' where") for m in logged)
    if target.secret is not None:
        assert not [html for html in shown if target.secret in html]
        assert target.secret not in caplog.text


async def states(admin: Any, keys: list[str]) -> list[str | None]:
    found = [await admin.lookup(QUEUE, key) for key in keys]
    return [None if request is None else request.state for request in found]


def filled(path: Path) -> tickler.SqliteStore:
    """A SQLite file a service filled (and left): one request succeeded, one failed."""

    async def run() -> None:
        store = tickler.SqliteStore(path, poll_interval=POLL)
        handler = functools.partial(handle, path.with_suffix(".fixed"))
        async with tickler.open_service(handler, store=store, name=QUEUE) as service:
            service.enqueue_request(FILL["order-8"][0], key="order-8")
            service.enqueue_request(FILL["refused"][0], key="refused")
            admin = store.admin()
            with trio.fail_after(10):
                while await states(admin, ["order-8", "refused"]) != ["succeeded", "failed"]:
                    await trio.sleep(POLL)
            await admin.aclose()

    trio.run(run)
    return tickler.SqliteStore(path, poll_interval=POLL)


def test_an_action_needs_the_pages_csrf_token(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A POST without the token of the page's cookie, or with another, changes nothing."""
    store = filled(tmp_path / "queue.db")
    admin = store.admin()
    refused = call(admin, "lookup", QUEUE, "refused")
    import httpx

    form = {"action": "retry", "queue": QUEUE, "id": str(refused.id)}
    with served(tickler.web.app(store)) as url, httpx.Client(base_url=url) as client:
        token = client.get("/").cookies["tickler_csrf"]
        assert client.post("/act", data=form).status_code == 403  # the cookie, no token
        assert client.post("/act", data={**form, "csrf": "x" * 43}).status_code == 403
        client.cookies.clear()
        assert client.post("/act", data={**form, "csrf": token}).status_code == 403  # no cookie
        assert call(admin, "lookup", QUEUE, "refused").state == "failed"
        client.cookies.set("tickler_csrf", token)
        done = client.post("/act", data={**form, "csrf": token})
        assert (done.status_code, done.headers["location"]) == (
            303,
            f"/request?queue={QUEUE}&id={refused.id}&done=retry&n={refused.id}",
        )
        assert call(admin, "lookup", QUEUE, "refused").state == "queued"
        again = client.post("/act", data={**form, "csrf": token}, follow_redirects=True)
        assert f"Request #{refused.id} was not retried" in again.text  # it is queued now
    call(admin, "aclose")
    refusals = [r for r in caplog.records if "without a valid CSRF token" in r.getMessage()]
    assert len(refusals) == 3


def test_a_bulk_retry_that_meets_a_key_taken_meanwhile_says_so(
    postgres_dsn: str, postgres_schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A request of a cancelled request's key commits while the bulk retry waits on it:
    the retry writes nothing, and the page says why, as a notice (not an error page)."""
    import httpx
    import psycopg

    caplog.set_level("INFO", logger="tickler")
    store = tickler.PostgresStore(postgres_dsn, schema=postgres_schema)
    store.create_schema()
    with psycopg.connect(postgres_dsn) as db:
        first = store.enqueue_in(db, QUEUE, {"do": "ok"}, key="k")
    admin = store.admin()
    assert call(admin, "cancel", QUEUE, first)
    with (
        served(tickler.web.app(store)) as url,
        httpx.Client(base_url=url) as client,
        psycopg.connect(postgres_dsn) as db,
    ):
        token = client.get("/").cookies["tickler_csrf"]
        second = store.enqueue_in(db, QUEUE, {"do": "ok"}, key="k")  # not committed yet
        committer = threading.Timer(0.5, db.commit)  # while the retry waits on the key
        committer.start()
        form = {"action": "bulk-retry", "queue": QUEUE, "state": "cancelled", "csrf": token}
        answer = client.post("/act", data=form)
        committer.join()
        assert answer.status_code == 303
        assert "done=bulk-retry-refused" in answer.headers["location"]
        page = client.get(answer.headers["location"])
    assert page.status_code == 200
    assert "Nothing was retried: a request of the key of one of them was enqueued" in page.text
    assert "StoreError" not in page.text
    assert call(admin, "lookup", QUEUE, first).state == "cancelled"
    assert call(admin, "lookup", QUEUE, second).state == "queued"
    call(admin, "aclose")
    assert any("bulk-retry of queue 'mail' refused" in m for m in caplog.messages)


async def _allow_header(request: Any) -> bool:
    await trio.sleep(0)
    return bool(request.headers.get("x-operator") == "ada")


@pytest.mark.parametrize(
    "check",
    [lambda request: request.headers.get("x-operator") == "ada", _allow_header],
    ids=["sync", "async"],
)
def test_auth_is_the_users_own_check(tmp_path: Path, check: Any) -> None:
    """``auth`` sees each request before any page, file or action: False is 403."""
    import httpx

    store = filled(tmp_path / "queue.db")
    with served(tickler.web.app(store, auth=check)) as url, httpx.Client(base_url=url) as client:
        for path in ["/", "/requests", "/static/tickler.js", "/replicas"]:
            assert client.get(path).status_code == 403, path
            assert client.get(path, headers={"x-operator": "ada"}).status_code == 200, path
        assert client.post("/act", data={"action": "pause", "queue": QUEUE}).status_code == 403
    admin = store.admin()
    assert call(admin, "counts", QUEUE)["paused"] == 0
    call(admin, "aclose")


def test_basic_auth_challenges_the_browser(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """BasicAuth answers 401 with a challenge until the user and password match; an
    action's log line names the user."""
    import httpx

    caplog.set_level("INFO", logger="tickler")
    store = filled(tmp_path / "queue.db")
    application = tickler.web.app(store, auth=tickler.web.BasicAuth("ops", "s3cret:pw"))
    with served(application) as url:
        for auth in [None, ("ops", "wrong"), ("ada", "s3cret:pw"), ("ops", "s3cret")]:
            refused = httpx.get(url + "/", auth=auth)
            assert refused.status_code == 401
            assert refused.headers["www-authenticate"].startswith('Basic realm="tickler"')
        with httpx.Client(base_url=url, auth=("ops", "s3cret:pw")) as client:
            assert client.get("/").status_code == 200
            token = client.cookies["tickler_csrf"]
            paused = client.post("/act", data={"action": "pause", "queue": QUEUE, "csrf": token})
            assert paused.status_code == 303
    assert "dashboard: pause of queue 'mail' (by 'ops' at 127.0.0.1)" in caplog.messages
    with pytest.raises(ValueError, match=r"^basic_auth's user must be non-empty and hold no ':'$"):
        tickler.web.BasicAuth("a:b", "pw")
    with pytest.raises(ValueError, match=r"^basic_auth's password must be non-empty$"):
        tickler.web.BasicAuth("ops", "")
    assert "s3cret" not in repr(tickler.web.BasicAuth("ops", "s3cret"))


def test_an_error_page_hides_the_dsns_password(caplog: pytest.LogCaptureFixture) -> None:
    """libpq quotes a malformed URL whole: the page and the log show its password as ***."""
    import httpx

    secret = "Hunter2-not-shown"  # noqa: S105 - the password under test
    store = tickler.PostgresStore(f"postgresql://ops:{secret}@[127.0.0.1:1/db", schema="tickler")
    with served(tickler.web.app(store)) as url:
        failed = httpx.get(url + "/")
    assert failed.status_code == 500
    assert "postgresql://ops:***@[127.0.0.1" in failed.text
    assert secret not in failed.text
    assert "dashboard: GET / failed" in caplog.text
    assert secret not in caplog.text


def test_mounted_under_a_prefix_with_a_refresh_that_pauses(
    browser: Browser, tmp_path: Path, artifacts: Path
) -> None:
    """Mounted in a user's Starlette app, every link, file and action stays under the
    mount; the page reloads itself every 5 s until its refresh is paused."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Mount, Route

    store = filled(tmp_path / "queue.db")

    async def home(request: Any) -> PlainTextResponse:
        return PlainTextResponse("the user's own page")

    users_app = Starlette(
        routes=[Route("/", home), Mount("/ops/tickler", app=tickler.web.app(store))]
    )
    with served(users_app) as url:
        context = browser.new_context()
        page = context.new_page()
        page.clock.install()
        page.goto(url + "/ops/tickler/")
        page.click("nav >> text=Requests")
        assert page.url.startswith(url + "/ops/tickler/requests")
        page.click("text=Overview")
        page.click(f"[data-queue='{QUEUE}'] button:has-text('Pause')")
        assert page.locator(".notice").inner_text().startswith("Paused: ")
        page.wait_for_url(url + "/ops/tickler/")  # the notice shows once: not on a reload
        assert cells(page, "data-field")["paused"] == "paused"
        page.screenshot(path=artifacts / "mounted-overview.png", full_page=True)

        # The script shipped in the package runs (the CSP lets no inline one) and reloads.
        toggle = page.locator("#refresh-toggle")
        assert toggle.inner_text() == "Pause refresh"
        assert page.locator("#refresh-state").inner_text() == "refreshes every 5 s"
        page.evaluate("window.reloaded = false")
        with page.expect_navigation():
            page.clock.run_for(5_100)
        assert page.evaluate("window.reloaded") is None
        toggle.click()
        assert toggle.inner_text() == "Resume refresh"
        page.evaluate("window.reloaded = false")
        page.clock.run_for(60_000)
        assert page.evaluate("window.reloaded") is False  # still this page
        page.reload()  # the pause holds across pages, for this tab
        assert page.locator("#refresh-state").inner_text() == "refresh paused"
        assert page.locator(".notice").count() == 0
        context.close()


def test_requests_page_by_page_and_filtered(tmp_path: Path) -> None:
    """50 a page, newest first; "Older" follows the last id shown, to the last page;
    the state, key and group filters select what the store selects; bad input is 400."""
    import sqlite3

    import httpx

    path = tmp_path / "queue.db"
    store = tickler.SqliteStore(path)
    store.create_schema()
    connection = sqlite3.connect(path)
    with connection:
        for number in range(1, 121):
            group = "eu" if number % 3 == 0 else None
            store.enqueue_in(connection, QUEUE, {"n": number}, key=f"k{number}", group=group)
    connection.close()

    def ids(html: str) -> list[int]:
        return [int(found) for found in re.findall(r'<tr data-id="(\d+)"', html)]

    with served(tickler.web.app(store)) as url, httpx.Client(base_url=url) as client:
        pages = []
        page = client.get(f"/requests?queue={QUEUE}")
        while True:
            pages.append(ids(page.text))
            older = re.search(r'id="next-page" href="([^"]+)"', page.text)
            if older is None:
                break
            page = client.get(older[1].replace("&amp;", "&"))
        assert pages == [
            list(range(120, 70, -1)),
            list(range(70, 20, -1)),
            list(range(20, 0, -1)),
        ]
        grouped = client.get(f"/requests?queue={QUEUE}&group=eu&state=queued")
        assert ids(grouped.text) == list(range(120, 0, -3))[:50]
        assert ids(client.get(f"/requests?queue={QUEUE}&key=k7").text) == [7]
        assert ids(client.get(f"/requests?queue={QUEUE}&state=failed").text) == []
        for bad, status in [
            (f"/requests?queue={QUEUE}&state=lost", 400),
            (f"/requests?queue={QUEUE}&after=x", 400),
            (f"/request?queue={QUEUE}&id=seven", 400),
            (f"/request?queue={QUEUE}&id=999", 404),
            ("/confirm?action=delete&queue=mail", 400),
        ]:
            assert client.get(bad).status_code == status, bad


def test_a_state_past_the_cap_shows_as_an_estimate(tmp_path: Path) -> None:
    """Past COUNT_CAP rows, the overview marks a count as not exact; the rest are exact,
    with their thousands marked."""
    import sqlite3

    import httpx

    from tickler._stores._admin import COUNT_CAP

    path = tmp_path / "queue.db"
    store = tickler.SqliteStore(path)
    store.create_schema()
    connection = sqlite3.connect(path)
    with connection:
        store.enqueue_many_in(connection, QUEUE, range(COUNT_CAP + 1))
        store.enqueue_many_in(connection, QUEUE, range(1234), delay=3600)
    connection.close()
    with served(tickler.web.app(store)) as url:
        page = httpx.get(url + "/").text
    queued = re.search(r'data-count="queued" title="([^"]*)"><a [^>]*>([^<]*)</a>', page)
    assert queued is not None
    assert queued.groups() == ("an estimate: more than 50,000 rows", "50,000+")
    assert re.search(r'data-count="scheduled"><a [^>]*>1,234</a>', page)


def test_app_and_serve_check_their_arguments(tmp_path: Path) -> None:
    store = tickler.SqliteStore(tmp_path / "queue.db")
    with pytest.raises(TypeError, match=r"^store must be a tickler store with an admin API"):
        tickler.web.app(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^read_only must be a bool$"):
        tickler.web.app(store, read_only=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^auth must be a callable taking a request, or None$"):
        tickler.web.app(store, auth="ops")  # type: ignore[arg-type]
    url = f"sqlite:///{tmp_path}/queue.db"
    with pytest.raises(ValueError, match=r"^port must be from 0 to 65535$"):
        tickler.web.serve(url, port=70000)
    with pytest.raises(TypeError, match=r"^port must be an int$"):
        tickler.web.serve(url, port="80")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^basic_auth must be a \(user, password\) pair of str$"):
        tickler.web.serve(url, basic_auth=("ops",))  # type: ignore[arg-type]


def forge(url: str, form: dict[str, str] | None = None) -> Any:
    """A POST of ``form`` to ``url``'s /act, with a valid CSRF cookie and token as a page
    would hold them (or a GET of ``url`` without a form)."""
    import httpx

    with httpx.Client(base_url=url) as client:
        if form is None:
            return client.get("")
        token = client.get("/").cookies["tickler_csrf"]
        return client.post("/act", data={**form, "csrf": token})


def enqueue(target: Target, requests: list[dict[str, Any]]) -> None:
    """Enqueue as a producer that runs no service: through its own connection."""
    store = target.dashboard_store
    if isinstance(store, tickler.SqliteStore):
        import sqlite3

        connection = sqlite3.connect(store.path)
        with connection:
            for request in requests:
                store.enqueue_in(connection, QUEUE, request)
        connection.close()
    else:
        import psycopg

        with psycopg.connect(store.dsn) as pg, pg.transaction():
            for request in requests:
                store.enqueue_in(pg, QUEUE, request)


# -- hardening: what a browser elsewhere, a rebinding name or a malformed query can do ------


AnyStore = tickler.SqliteStore | tickler.PostgresStore


@pytest.fixture(params=["sqlite", "postgres"])
def empty_store(request: pytest.FixtureRequest, tmp_path: Path) -> AnyStore:
    """A store with its schema and no rows: a SQLite file, or a PostgreSQL schema."""
    store: AnyStore
    if request.param == "sqlite":
        store = tickler.SqliteStore(tmp_path / "queue.db")
    else:
        dsn: str = request.getfixturevalue("postgres_dsn")
        store = tickler.PostgresStore(dsn, schema=request.getfixturevalue("postgres_schema"))
    store.create_schema()
    return store


def put(store: AnyStore, queue: str, request: object, **options: Any) -> int:
    """Enqueue one request as a producer running no service does; its id."""
    if isinstance(store, tickler.SqliteStore):
        import sqlite3

        connection = sqlite3.connect(store.path)
        with connection:
            found = store.enqueue_in(connection, queue, request, **options)
        connection.close()
    else:
        import psycopg

        with psycopg.connect(store.dsn) as pg:
            found = store.enqueue_in(pg, queue, request, **options)
    assert found is not None
    return found


def write_run_at(store: AnyStore, request_id: int, run_at: float) -> None:
    """Set a row's due time in the store's table, as an older version (or another
    program) may have written it."""
    if isinstance(store, tickler.SqliteStore):
        import sqlite3

        connection = sqlite3.connect(store.path)
        with connection:
            connection.execute(
                "UPDATE tickler_requests SET run_at = ? WHERE id = ?", (run_at, request_id)
            )
        connection.close()
    else:
        import psycopg

        table = f'"{store.schema}".tickler_requests'
        with psycopg.connect(store.dsn) as pg:
            update = f"UPDATE {table} SET run_at = %s WHERE id = %s"  # noqa: S608 - its own schema
            pg.execute(update, (run_at, request_id))


def token_of(client: Any) -> str:
    """The CSRF token a page of the dashboard gives ``client`` (in its cookie and forms)."""
    page = client.get("/")
    assert page.status_code == 200
    return str(client.cookies["tickler_csrf"])


def assert_secured(response: Any) -> None:
    from tickler.web._app import SECURITY_HEADERS

    for name, value in SECURITY_HEADERS.items():
        assert response.headers.get(name) == value, (response.request.url, name)


def act_with(url: str, token: str, form: dict[str, str], **headers: str) -> Any:
    """A POST of ``form`` to ``url``'s /act, with ``token`` in the cookie and the form."""
    import httpx

    cookie = {"cookie": f"tickler_csrf={token}"}
    return httpx.post(url + "/act", data={**form, "csrf": token}, headers={**cookie, **headers})


def test_a_planted_or_foreign_token_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The token must be one this dashboard signed, and a browser's POST must come from
    the dashboard's own origin, whatever the cookie holds."""
    import httpx

    store = filled(tmp_path / "queue.db")
    admin = store.admin()
    pause = {"action": "pause", "queue": QUEUE}
    with served(tickler.web.app(store)) as url:
        with httpx.Client(base_url=url) as client:
            own = token_of(client)
        # A pair planted by another site: well formed, equal in cookie and form, unsigned.
        for planted in ["a" * 43, "nonce-of-its-own." + "m" * 43, own.split(".")[0] + ".x"]:
            refused = act_with(url, planted, pause)
            assert refused.status_code == 403, planted
            assert_secured(refused)
        # A token signed by another dashboard (another secret) is no better.
        with served(tickler.web.app(store)) as other, httpx.Client(base_url=other) as stranger:
            foreign = token_of(stranger)
        assert act_with(url, foreign, pause).status_code == 403
        # The dashboard's own token, posted by a page of another origin or site.
        for headers in [
            {"origin": "http://127.0.0.1:1"},
            {"origin": "http://rebind.attacker.example"},
            {"origin": "null"},
            {"sec-fetch-site": "same-site"},
            {"sec-fetch-site": "cross-site"},
            {"sec-fetch-site": "none"},
            {"origin": url, "sec-fetch-site": "same-site"},
        ]:
            refused = act_with(url, own, pause, **headers)
            assert refused.status_code == 403, headers
            assert "came from another site" in refused.text
        assert call(admin, "counts", QUEUE)["paused"] == 0
        # From its own page (as Chromium sends it), and from a client that is no browser.
        same = {"origin": url, "sec-fetch-site": "same-origin"}
        assert act_with(url, own, pause, **same).status_code == 303
        assert call(admin, "counts", QUEUE)["paused"] == 1
        assert act_with(url, own, {"action": "resume", "queue": QUEUE}).status_code == 303
        assert call(admin, "counts", QUEUE)["paused"] == 0
    call(admin, "aclose")
    assert sum("from another site" in m for m in caplog.messages) == 7


def test_a_shared_secret_signs_for_every_process(tmp_path: Path) -> None:
    """Two applications given one secret take each other's tokens (processes behind one
    address); the secret is checked."""
    import httpx

    store = filled(tmp_path / "queue.db")
    secret = "a secret the processes share"  # noqa: S105 - the secret under test
    first, second = (tickler.web.app(store, secret=secret) for _ in range(2))
    with served(first) as one, served(second) as two:
        with httpx.Client(base_url=one) as client:
            token = token_of(client)
        with httpx.Client(base_url=two, cookies={"tickler_csrf": token}) as client:
            answer = client.post("/act", data={"action": "pause", "queue": QUEUE, "csrf": token})
            assert answer.status_code == 303
    with pytest.raises(ValueError, match=r"^secret must be at least 16 bytes long$"):
        tickler.web.app(store, secret="short")  # noqa: S106 - too short, refused
    with pytest.raises(TypeError, match=r"^secret must be a str, bytes or None$"):
        tickler.web.app(store, secret=16 * [1])  # type: ignore[arg-type]


ATTACK = """<!doctype html><html><body>
<form id="forged" method="post" action="{dashboard}/act">
<input name="csrf" value="{token}"><input name="action" value="pause">
<input name="queue" value="{queue}"></form>
<script>
document.cookie = "tickler_csrf={token}; path=/";
document.getElementById("forged").submit();
</script></body></html>"""


def test_a_page_on_another_port_cannot_act(browser: Browser, tmp_path: Path) -> None:
    """The attack in Chromium: a page on another port of 127.0.0.1 plants the cookie
    (cookies ignore ports) and submits its form to /act. Refused, whether the token is
    made up or one the dashboard signed (read by a process of the same machine); the
    dashboard's own button still acts."""
    import httpx
    from starlette.applications import Starlette
    from starlette.responses import HTMLResponse
    from starlette.routing import Route

    store = filled(tmp_path / "queue.db")
    admin = store.admin()
    with served(tickler.web.app(store)) as dashboard:
        with httpx.Client(base_url=dashboard) as client:
            signed = token_of(client)
        for token in ["a" * 43, signed]:

            async def attack(request: Any, token: str = token) -> HTMLResponse:
                page = ATTACK.format(dashboard=dashboard, token=token, queue=QUEUE)
                return HTMLResponse(page)

            with served(Starlette(routes=[Route("/", attack)])) as attacker:
                assert attacker.rsplit(":", 1)[1] != dashboard.rsplit(":", 1)[1]
                context = browser.new_context()
                page = context.new_page()
                with page.expect_response(lambda r: r.url == dashboard + "/act") as posted:
                    page.goto(attacker + "/")
                assert posted.value.status == 403, token
                sent = posted.value.request.all_headers()
                assert sent["cookie"] == f"tickler_csrf={token}"  # planted, and sent
                assert sent["sec-fetch-site"] == "same-site"  # ports make no other site
                context.close()
            assert call(admin, "counts", QUEUE)["paused"] == 0, token
        context = browser.new_context()
        page = context.new_page()
        page.goto(dashboard + "/")
        page.click(f"[data-queue='{QUEUE}'] button:has-text('Pause')")
        assert page.locator(".notice").inner_text().startswith("Paused: ")
        assert call(admin, "counts", QUEUE)["paused"] == 1
        context.close()
    call(admin, "aclose")


def test_only_this_machines_names_or_the_allowed_ones_are_served(tmp_path: Path) -> None:
    """A Host other than localhost, 127.0.0.1, [::1], the connection's own address or
    allowed_hosts is refused with 400 on every route, POST included (DNS rebinding)."""
    import httpx

    store = filled(tmp_path / "queue.db")
    admin = store.admin()
    refused = call(admin, "lookup", QUEUE, "refused")
    paths = [
        "/",
        f"/requests?queue={QUEUE}",
        f"/request?queue={QUEUE}&id={refused.id}",
        "/replicas",
        f"/confirm?action=retry&queue={QUEUE}",
        "/static/tickler.css",
        "/favicon.ico",
        "/no-such-page",
    ]
    application = tickler.web.app(store, allowed_hosts=["ops.example.com", "*.corp.example"])
    with served(application) as url, httpx.Client(base_url=url) as client:
        port = url.rsplit(":", 1)[1]
        token = token_of(client)
        form = {"action": "pause", "queue": QUEUE, "csrf": token}
        for host in ["rebind.attacker.example", f"rebind.attacker.example:{port}", "corp.example"]:
            for path in paths:
                answer = client.get(path, headers={"host": host})
                assert answer.status_code == 400, (host, path)
                assert_secured(answer)
            assert client.post("/act", data=form, headers={"host": host}).status_code == 400
        assert call(admin, "counts", QUEUE)["paused"] == 0
        for host in [f"localhost:{port}", "127.0.0.1", "ops.example.com", "eu.corp.example"]:
            for path in paths[:-1]:
                assert client.get(path, headers={"host": host}).status_code == 200, (host, path)
        answer = client.post("/act", data=form, headers={"host": f"localhost:{port}"})
        assert answer.status_code == 303
    call(admin, "aclose")
    with pytest.raises(ValueError, match=r"^allowed_hosts: 'ops.example.com:80' is not a host"):
        tickler.web.app(store, allowed_hosts=["ops.example.com:80"])
    with pytest.raises(TypeError, match=r"^allowed_hosts must be a list \(or tuple\) of host"):
        tickler.web.app(store, allowed_hosts="ops.example.com")  # type: ignore[arg-type]
    tickler.web.app(store, allowed_hosts=("::1", "*", "10.0.0.7"))


def test_the_address_a_connection_came_in_on_is_its_own_host(tmp_path: Path) -> None:
    """Bound to another address (as to every interface), the dashboard answers by the
    address it was reached at (scope["server"]), and still refuses any other name."""
    import httpx

    store = filled(tmp_path / "queue.db")
    with served(tickler.web.app(store), host="127.0.0.2") as url:
        port = url.rsplit(":", 1)[1]
        assert httpx.get(url + "/").status_code == 200
        for host in ["127.0.0.3", f"127.0.0.3:{port}", "rebind.attacker.example", "[::2]"]:
            assert httpx.get(url + "/", headers={"host": host}).status_code == 400, host


def test_actions_land_on_the_queue_and_key_as_named(empty_store: AnyStore) -> None:
    """Nothing is stripped: Pause on the card of "mail " pauses "mail " (not "mail"), and
    a bulk cancel of the key " k" cancels its request (not that of "k")."""
    import html

    import httpx

    store = empty_store
    put(store, "mail", {"n": 1})
    put(store, "mail ", {"n": 2})
    padded = put(store, "mail", {"n": 3}, key=" k")
    bare = put(store, "mail", {"n": 4}, key="k")
    admin = store.admin()
    with served(tickler.web.app(store)) as url, httpx.Client(base_url=url) as client:
        token = token_of(client)
        overview = client.get("/").text
        card = re.search(r'<section class="queue" data-queue="mail ">.*?</section>', overview, re.S)
        assert card is not None
        fields = dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)">', card[0]))
        assert fields["queue"] == "mail "
        assert client.post("/act", data={**fields, "action": "pause"}).status_code == 303
        assert call(admin, "counts", "mail ")["paused"] == 1
        assert call(admin, "counts", "mail")["paused"] == 0
        listed = client.get("/requests", params={"queue": "mail", "key": " k"}).text
        assert re.findall(r'<tr data-id="(\d+)"', listed) == [str(padded)]
        confirm = client.get("/confirm", params={"action": "cancel", "queue": "mail", "key": " k"})
        assert html.unescape(confirm.text).count('name="key" value=" k"') == 1
        form = {"action": "bulk-cancel", "queue": "mail", "key": " k", "csrf": token}
        done = client.post("/act", data=form)
        assert done.status_code == 303
        assert "n=1" in done.headers["location"]
    assert call(admin, "lookup", "mail", padded).state == "cancelled"
    assert call(admin, "lookup", "mail", bare).state == "queued"
    call(admin, "aclose")


def test_a_time_past_the_calendar_renders(empty_store: AnyStore) -> None:
    """A due time past datetime's years (a delay of 1e12 s, written before the bound, or
    by another program) shows as the bound it passes, on every page."""
    import httpx

    store = empty_store
    ids = {run_at: put(store, QUEUE, {"run_at": str(run_at)}) for run_at in [1e12, -1e12, math.inf]}
    for run_at, request_id in ids.items():
        write_run_at(store, request_id, run_at)
    with served(tickler.web.app(store)) as url, httpx.Client(base_url=url) as client:
        listed = client.get(f"/requests?queue={QUEUE}")
        assert listed.status_code == 200, listed.text
        assert 'title="after 9999-12-31"' in listed.text
        assert 'title="before 0001-01-01"' in listed.text
        assert client.get("/").status_code == 200
        for run_at, request_id in ids.items():
            shown = client.get(f"/request?queue={QUEUE}&id={request_id}")
            assert shown.status_code == 200, (run_at, shown.text)
            due = re.search(r'<dd id="due">(.*?)</dd>', shown.text, re.S)
            assert due is not None
            bound = "after 9999-12-31" if run_at > 0 else "before 0001-01-01"
            assert due[1].startswith(bound), due[1]


@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("/?done=cancel&n=²", "n"),
        ("/?done=cancel&n=-1", "n"),
        ("/?done=cancel&n=1e3", "n"),
        ("/?done=pwned&n=1", "done"),
        (f"/requests?queue={QUEUE}&after=9999999999999999999", "after"),
        (f"/requests?queue={QUEUE}&after=-5", "after"),
        (f"/requests?queue={QUEUE}&after=%EF%BC%91", "after"),  # a fullwidth 1
        (f"/requests?queue={QUEUE}&after={'9' * 500}", "after"),
        (f"/requests?queue={QUEUE}&state=lost", "state"),
        (f"/request?queue={QUEUE}&id=seven", "id"),
        (f"/request?queue={QUEUE}&id=-1", "id"),
        (f"/request?queue={QUEUE}&id=%201", "id"),
        (f"/request?queue={QUEUE}&id=99999999999999999999999", "id"),
        (f"/confirm?action=delete&queue={QUEUE}", "action"),
        ("/request?queue=a%00b&id=1", "queue"),
    ],
)
def test_a_malformed_parameter_is_400_naming_it(tmp_path: Path, path: str, name: str) -> None:
    """Each parameter is read by one helper: a bad one is 400 with a message that names
    it, on a page with the security headers (never Starlette's bare 500)."""
    import httpx

    store = tickler.SqliteStore(tmp_path / "queue.db")
    store.create_schema()
    put(store, QUEUE, {"n": 1})
    with served(tickler.web.app(store)) as url, httpx.Client(base_url=url) as client:
        answer = client.get(path)
        assert answer.status_code == 400, answer.text
        message = re.search(r'id="error-message">([^<]*)<', answer.text)
        assert message is not None, answer.text
        assert message[1].startswith(name + " must "), message[1]
        assert_secured(answer)
        token = token_of(client)
        form = {"action": "cancel", "queue": QUEUE, "id": "²", "csrf": token}
        posted = client.post("/act", data=form)
        assert posted.status_code == 400
        assert "id must be a whole number" in posted.text
        assert_secured(posted)


def test_no_query_or_form_makes_a_500(tmp_path: Path) -> None:
    """Random queries on every page, and random forms posted with a valid token: a page
    or a 4xx with the security headers, never a 500."""
    import httpx
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    store = tickler.SqliteStore(tmp_path / "queue.db")
    store.create_schema()
    put(store, QUEUE, {"n": 1}, key="k")
    names = ["queue", "state", "key", "group", "after", "id", "action", "done", "n", "csrf"]
    # Text, numbers of any size, and what has broken pages before: digits str.isdigit()
    # takes and int() refuses, ids past 64 bits, a NUL, a lone surrogate, padded names.
    edges = ["²", "٣", "9" * 19, "9" * 20, str(2**63), "-1", " 1", "1e3", "\x00", "\ud800"]
    words = [QUEUE, " mail", "k", "1", "0", "queued", "failed", "cancel", "retry", "pause"]
    words += ["resume", "bulk-cancel", "bulk-retry", "%", "&", "="]
    values = st.one_of(
        st.sampled_from(edges),
        st.sampled_from(words),
        st.text(max_size=30),
        st.integers(min_value=-(2**70), max_value=2**70).map(str),
    )
    queries = st.fixed_dictionaries({}, optional=dict.fromkeys(names, values)).map(
        lambda query: list(query.items())
    )
    pages = st.sampled_from(["/", "/requests", "/request", "/replicas", "/confirm"])
    with served(tickler.web.app(store)) as url, httpx.Client(base_url=url) as client:
        token = token_of(client)

        @settings(
            max_examples=500,
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture],
        )
        @given(page=pages, query=queries, post=st.booleans())
        def check(page: str, query: list[tuple[str, str]], post: bool) -> None:
            encoded = urllib.parse.urlencode(query, errors="surrogatepass")
            if post:
                form = encoded + "&csrf=" + token
                answer = client.post(
                    "/act",
                    content=form,
                    headers={"content-type": "application/x-www-form-urlencoded"},
                )
            else:
                answer = client.get(f"{page}?{encoded}")
            assert answer.status_code < 500, (page, query, post, answer.text[-500:])
            assert_secured(answer)

        check()


def test_a_cancel_says_what_it_did_and_a_final_request_has_no_due_time(
    empty_store: AnyStore,
) -> None:
    """Cancelling a scheduled (or queued) request says it was cancelled before any
    attempt ran, never that a running attempt is; once final, it shows no due time."""
    import httpx

    store = empty_store
    scheduled = put(store, QUEUE, {"n": 1}, delay=3600)
    queued = put(store, QUEUE, {"n": 2})
    with served(tickler.web.app(store)) as url, httpx.Client(base_url=url) as client:
        token = token_of(client)
        before = client.get(f"/request?queue={QUEUE}&id={scheduled}").text
        assert re.search(r'<dd id="due">\d{4}-\d\d-\d\d [^<]*<span class="muted">in 5', before)
        for request_id in [scheduled, queued]:
            form = {"action": "cancel", "queue": QUEUE, "id": str(request_id), "csrf": token}
            page = client.post("/act", data=form, follow_redirects=True)
            notice = re.search(r'<p class="notice" role="status">([^<]*)</p>', page.text)
            assert notice is not None
            assert notice[1] == (
                f"Cancelled request #{request_id} before its next attempt started:"
                " no attempt of it runs."
            )
            assert "running" not in page.text.split('id="due"')[0].split("<main>")[1]
            assert '<dd id="due">— <span class="muted">(final)</span></dd>' in page.text


def failed_with(path: Path, to: str) -> tuple[tickler.SqliteStore, int]:
    """A SQLite file holding one request that failed with an error naming ``to``."""

    async def run() -> int:
        store = tickler.SqliteStore(path, poll_interval=POLL)
        handler = functools.partial(handle, path.with_suffix(".fixed"))
        async with tickler.open_service(handler, store=store, name=QUEUE) as service:
            service.enqueue_request({"do": "fail", "to": to}, key="long")
            admin = store.admin()
            with trio.fail_after(10):
                while await states(admin, ["long"]) != ["failed"]:
                    await trio.sleep(POLL)
            found = await admin.lookup(QUEUE, "long")
            await admin.aclose()
        assert found is not None
        return int(found.id)

    request_id = trio.run(run)
    return tickler.SqliteStore(path, poll_interval=POLL), request_id


def test_a_long_unbroken_error_wraps(browser: Browser, tmp_path: Path, artifacts: Path) -> None:
    """An error of 20,000 characters without a space (a URL, base64) wraps: no page is
    wider than the window."""
    import base64

    unbroken = base64.b64encode(os.urandom(15_000)).decode()
    assert len(unbroken) == 20_000
    store, request_id = failed_with(tmp_path / "queue.db", unbroken)
    with served(tickler.web.app(store)) as url:
        context = browser.new_context(viewport={"width": 1280, "height": 800})
        page = context.new_page()
        for path, name in [
            (f"/request?queue={QUEUE}&id={request_id}", "long-error-detail"),
            (f"/requests?queue={QUEUE}", "long-error-requests"),
        ]:
            page.goto(url + path)
            assert unbroken[:50] in page.content()
            width = page.evaluate("document.documentElement.scrollWidth")
            assert width <= 1280, (path, width)
            page.screenshot(path=artifacts / f"{name}.png", full_page=False)
        error = page.goto(url + f"/request?queue={QUEUE}&id={request_id}")
        assert error is not None
        box = page.locator("#error").bounding_box()
        assert box is not None
        assert box["x"] + box["width"] <= 1280, box
        page.locator("#error").scroll_into_view_if_needed()
        page.screenshot(path=artifacts / "long-error-message.png")
        context.close()


def _rgb(css: str) -> tuple[float, float, float, float]:
    found = re.fullmatch(r"rgba?\(([\d.]+), ([\d.]+), ([\d.]+)(?:, ([\d.]+))?\)", css)
    assert found is not None, css
    red, green, blue, alpha = found.groups()
    return float(red), float(green), float(blue), 1.0 if alpha is None else float(alpha)


def contrast(foreground: str, background: str) -> float:
    """WCAG 2's contrast ratio of two opaque CSS colours."""

    def luminance(css: str) -> float:
        *channels, alpha = _rgb(css)
        assert alpha == 1.0, css
        linear = [
            c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4
            for c in (channel / 255 for channel in channels)
        ]
        return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]

    light, dark = sorted([luminance(foreground), luminance(background)], reverse=True)
    return (light + 0.05) / (dark + 0.05)


# The colour an element's text is drawn on: its own background, or the first opaque one
# of its ancestors.
SHOWN_COLOURS = """element => {
  const color = getComputedStyle(element).color;
  for (let node = element; node; node = node.parentElement) {
    const background = getComputedStyle(node).backgroundColor;
    if (background !== "rgba(0, 0, 0, 0)" && background !== "transparent") {
      return [color, background];
    }
  }
  return [color, "rgb(255, 255, 255)"];
}"""


def test_the_refresh_button_reads_on_hover_and_the_favicon_is_served(
    browser: Browser, tmp_path: Path, artifacts: Path
) -> None:
    """The header's button keeps a contrast of at least 4.5:1 (WCAG AA) at rest and under
    the pointer; /favicon.ico and the icon the pages name are served, no page asks
    for anything that is not there."""
    import httpx

    store = filled(tmp_path / "queue.db")
    with served(tickler.web.app(store)) as url:
        icon = httpx.get(url + "/favicon.ico")
        assert icon.status_code == 200
        assert icon.headers["content-type"] == "image/vnd.microsoft.icon"
        assert icon.content[:4] == b"\x00\x00\x01\x00"  # an ICO file's header
        linked = httpx.get(url + "/static/favicon.ico")
        assert (linked.status_code, linked.content) == (200, icon.content)
        context = browser.new_context()
        page = context.new_page()
        missing: list[str] = []
        page.on("response", lambda r: missing.append(r.url) if r.status >= 400 else None)
        page.goto(url + "/")
        toggle = page.locator("#refresh-toggle")
        at_rest = toggle.evaluate(SHOWN_COLOURS)
        assert contrast(*at_rest) >= 4.5, at_rest
        toggle.hover()
        hovered = toggle.evaluate(SHOWN_COLOURS)
        assert hovered != at_rest  # the hover shows
        assert contrast(*hovered) >= 4.5, hovered
        page.locator("header").screenshot(path=artifacts / "header-hover.png")
        named = page.locator("link[rel=icon]").evaluate("link => link.href")
        assert named == url + "/static/favicon.ico"
        assert missing == []
        context.close()


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        kind, target_, schema, flag_ = sys.argv[2:6]
        trio.run(work, kind, target_, schema, flag_, "--fill" in sys.argv[6:])
    else:
        raise SystemExit("usage: python -m tests.test_web worker KIND TARGET SCHEMA FLAG [--fill]")
