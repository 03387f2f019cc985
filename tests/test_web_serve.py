"""tickler.web.serve, as ``python -m tickler web URL`` calls it: a real server process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx

from tests.test_web import filled


def test_serve_binds_to_this_machine_only(tmp_path: Path) -> None:
    """serve() listens on 127.0.0.1 unless told otherwise, with Basic auth and read-only
    as asked."""
    store = filled(tmp_path / "queue.db")
    code = (
        "import tickler.web; tickler.web.serve("
        f"'sqlite:///{store.path}', port=0, read_only=True, basic_auth=('ops', 'pw'))"
    )
    server = subprocess.Popen(  # noqa: S603 - our own interpreter
        [sys.executable, "-c", code], stderr=subprocess.PIPE, text=True
    )
    try:
        assert server.stderr is not None
        line = server.stderr.readline()
        while "Running on" not in line:
            assert line, "the server ended"
            line = server.stderr.readline()
        url = line.split("Running on ")[1].split()[0]
        assert url.startswith("http://127.0.0.1:")
        assert httpx.get(url + "/").status_code == 401
        page = httpx.get(url + "/", auth=("ops", "pw"))
        assert page.status_code == 200
        assert 'data-queue="mail"' in page.text
        assert 'name="action"' not in page.text
    finally:
        server.terminate()
        server.wait()
        assert server.stderr is not None
        server.stderr.close()
