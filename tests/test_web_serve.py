"""tickler.web.serve, as ``python -m tickler web URL`` calls it: a real server process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.test_web import filled


def running_on(server: subprocess.Popen[str]) -> str:
    """The URL the server's readiness line gives ("Running on URL"), read from its stderr;
    fails if the server ends before it says so."""
    assert server.stderr is not None
    line = server.stderr.readline()
    while "Running on" not in line:
        assert line, "the server ended before it said it was running"
        line = server.stderr.readline()
    return str(line.split("Running on ")[1].split()[0])


def test_serve_binds_to_this_machine_only(tmp_path: Path) -> None:
    """serve() listens on 127.0.0.1 unless told otherwise, with Basic auth and read-only
    as asked."""
    store = filled(tmp_path / "queue.db")
    code = (
        "import tickler.web; tickler.web.serve("
        f"'sqlite:///{store.path}', port=0, read_only=True, basic_auth=('ops', 'pw'),"
        " allowed_hosts=['ops.example.com'])"
    )
    server = subprocess.Popen(  # noqa: S603 - our own interpreter
        [sys.executable, "-c", code], stderr=subprocess.PIPE, text=True
    )
    try:
        url = running_on(server)
        assert url.startswith("http://127.0.0.1:")
        assert httpx.get(url + "/").status_code == 401
        page = httpx.get(url + "/", auth=("ops", "pw"))
        assert page.status_code == 200
        assert 'data-queue="mail"' in page.text
        assert 'name="action"' not in page.text
        # A name given in allowed_hosts is answered; any other is not (DNS rebinding).
        named = httpx.get(url + "/", auth=("ops", "pw"), headers={"Host": "ops.example.com"})
        assert named.status_code == 200
        assert 'data-queue="mail"' in named.text
        other = httpx.get(url + "/", auth=("ops", "pw"), headers={"Host": "evil.example.com"})
        assert other.status_code == 400
    finally:
        server.terminate()
        server.wait()
        assert server.stderr is not None
        server.stderr.close()


def test_the_command_line_serves_a_postgres_schema_of_its_choice(
    postgres_dsn: str, postgres_schema: str
) -> None:
    """python -m tickler web --schema, as every other command: the dashboard of a queue
    outside the default schema."""
    import psycopg

    import tickler

    store = tickler.PostgresStore(postgres_dsn, schema=postgres_schema)
    store.create_schema()
    with psycopg.connect(postgres_dsn, autocommit=True) as connection:
        store.enqueue_in(connection, "mail", 1)
    server = subprocess.Popen(  # noqa: S603 - our own interpreter running our own module
        [
            sys.executable,
            "-m",
            "tickler",
            "web",
            postgres_dsn,
            "--schema",
            postgres_schema,
            "--port",
            "0",
            "--read-only",
            "--allowed-host",
            "ops.example.com",
            "--allowed-host",
            "*.corp.example",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = running_on(server)
        page = httpx.get(url + "/", timeout=30)
        assert page.status_code == 200
        assert 'data-queue="mail"' in page.text
        # Each --allowed-host is answered to; any other name is refused.
        for host in ("ops.example.com", "a.corp.example"):
            named = httpx.get(url + "/", headers={"Host": host}, timeout=30)
            assert named.status_code == 200, host
            assert 'data-queue="mail"' in named.text
        other = httpx.get(url + "/", headers={"Host": "evil.example.com"}, timeout=30)
        assert other.status_code == 400
    finally:
        server.terminate()
        server.wait()
        assert server.stderr is not None
        server.stderr.close()
    # The default schema ("tickler") is not this one.
    assert postgres_schema != "tickler"


def test_serve_checks_allowed_hosts_before_it_opens_the_store(tmp_path: Path) -> None:
    """A malformed allowed_hosts is refused, naming it, before any file is created."""
    import tickler.web

    path = tmp_path / "never.db"
    with pytest.raises(ValueError, match=r"^allowed_hosts: 'ops.example.com:80' is not a host"):
        tickler.web.serve(f"sqlite:///{path}", port=0, allowed_hosts=["ops.example.com:80"])
    with pytest.raises(TypeError, match=r"^allowed_hosts must be a list \(or tuple\) of host"):
        tickler.web.serve(f"sqlite:///{path}", port=0, allowed_hosts="ops.example.com")  # type: ignore[arg-type]
    assert not path.exists()
