"""docs/recipes.md: every code block on the page runs, and does what the page says.

Each block is named by the ``<!-- example: NAME -->`` line just above its
fence, as on every page, and read by tests/test_docs.py's ``read_blocks``:
a Python block by the file it is saved as, a shell block by what it runs.
The servers are real: Hypercorn in a subprocess on a free localhost port,
real HTTP requests, real signals, and the emails the handler writes to
``outbox.txt`` in the server's directory.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import attrs
import httpx
import pytest

from .test_docs import read_blocks

ROOT = Path(__file__).parent.parent
RECIPES = ROOT / "docs" / "recipes.md"
BLOCKS = read_blocks(RECIPES.read_text())
ADDRESSES = [f"user{number}@example.com" for number in range(4)]
SENT = sorted(f"welcome mail to {address}" for address in ADDRESSES)


def test_every_block_is_named_and_run() -> None:
    """The page's blocks are exactly the ones the tests below save and run."""
    assert {name: block.language for name, block in BLOCKS.items()} == {
        "app.py": "python",
        "run-app": "sh",
        "serve.py": "python",
        "run-serve": "sh",
        "test_welcome.py": "python",
        "run-tests": "sh",
    }


def save(directory: Path, *names: str) -> None:
    for name in names:
        (directory / name).write_text(BLOCKS[name].code)


def command(name: str) -> list[str]:
    """The one-line shell block ``name``, as the argv that runs it with this interpreter."""
    (line,) = BLOCKS[name].code.splitlines()
    program, *arguments = shlex.split(line)
    if program == "python":
        return [sys.executable, *arguments]
    return [sys.executable, "-m", program, *arguments]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def outbox(directory: Path) -> list[str]:
    path = directory / "outbox.txt"
    return sorted(path.read_text().splitlines()) if path.exists() else []


@attrs.frozen
class Server:
    process: subprocess.Popen[bytes]
    directory: Path
    url: str

    def output(self) -> str:
        return (self.directory / "stdout.txt").read_text()

    def errors(self) -> str:
        return (self.directory / "stderr.txt").read_text()

    def signal(self, signum: signal.Signals, *, group: bool = False) -> None:
        """Signal the server, or its whole process group (as Ctrl-C in a terminal does)."""
        if group:
            os.killpg(self.process.pid, signum)
        else:
            self.process.send_signal(signum)

    def sign_up(self) -> None:
        """POST every address; each answer comes at once, before its email goes out."""
        with httpx.Client(base_url=self.url) as client:
            for number, address in enumerate(ADDRESSES, start=1):
                response = client.post("/signup", json={"email": address})
                assert (response.status_code, response.json()) == (202, {"ticket": number})
                assert response.elapsed.total_seconds() < 1.0  # the handler takes 1 s
        # capacity=2 and a second per email: most of them are still to be sent.
        assert len(outbox(self.directory)) < len(ADDRESSES)


@contextmanager
def running(argv: list[str], directory: Path, port: int) -> Iterator[Server]:
    """Start ``argv`` in ``directory`` with PORT set; yield once it answers HTTP."""
    with (
        (directory / "stdout.txt").open("wb") as stdout,
        (directory / "stderr.txt").open("wb") as stderr,
    ):
        process = subprocess.Popen(  # noqa: S603 - this interpreter, running the page's blocks
            argv,
            cwd=directory,
            env={**os.environ, "PORT": str(port)},
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,  # its own process group, for Ctrl-C and the cleanup
        )
    server = Server(process, directory, f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 10
        while True:
            if process.poll() is not None:
                pytest.fail(f"the server exited with {process.returncode}:\n{server.errors()}")
            try:
                httpx.get(f"{server.url}/", timeout=1.0)  # a 404: it answers
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    pytest.fail(f"the server did not answer within 10 s:\n{server.errors()}")
                time.sleep(0.05)
        yield server
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def assert_drained_on(server: Server, signum: signal.Signals, *, group: bool = False) -> None:
    """The signal shuts the server down cleanly, after every accepted email went out."""
    server.signal(signum, group=group)
    assert server.process.wait(timeout=15) == 0, server.errors()
    assert outbox(server.directory) == SENT
    assert "Traceback" not in server.errors()


@pytest.mark.parametrize(
    ("signum", "group"),
    [(signal.SIGTERM, False), (signal.SIGINT, True)],
    ids=["SIGTERM", "Ctrl-C"],
)
def test_the_hypercorn_command_drains_the_lifespans_service(
    tmp_path: Path, signum: signal.Signals, group: bool
) -> None:
    """``hypercorn -k trio app:app``: 202s at once, and a signal drains the queue before exit."""
    save(tmp_path, "app.py")
    port = free_port()
    argv = [*command("run-app"), "--bind", f"127.0.0.1:{port}"]
    assert argv[1:] == ["-m", "hypercorn", "-k", "trio", "app:app", "--bind", f"127.0.0.1:{port}"]
    with running(argv, tmp_path, port) as server:
        server.sign_up()
        assert_drained_on(server, signum, group=group)


def test_sigterm_to_the_whole_process_group_loses_the_queue(tmp_path: Path) -> None:
    """As the page warns: Hypercorn's worker does not handle SIGTERM, and dies at once."""
    save(tmp_path, "app.py")
    port = free_port()
    with running([*command("run-app"), "--bind", f"127.0.0.1:{port}"], tmp_path, port) as server:
        server.sign_up()
        server.signal(signal.SIGTERM, group=True)
        server.process.wait(timeout=15)
        assert len(outbox(tmp_path)) < len(ADDRESSES)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_with_a_signal_trigger_drains_the_service(
    tmp_path: Path, signum: signal.Signals
) -> None:
    """``python serve.py``: the trigger turns the signal into a drain, then exit 0."""
    save(tmp_path, "app.py", "serve.py")
    assert command("run-serve") == [sys.executable, "serve.py"]
    with running(command("run-serve"), tmp_path, free_port()) as server:
        server.sign_up()
        assert_drained_on(server, signum)
        assert server.output() == f"{signum.name}: shutting down\n"


def test_a_second_sigterm_ends_serve_at_once(tmp_path: Path) -> None:
    """The receiver closes with the first signal: the second is not caught."""
    save(tmp_path, "app.py", "serve.py")
    with running(command("run-serve"), tmp_path, free_port()) as server:
        server.sign_up()
        server.signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while "shutting down" not in server.output():
            assert time.monotonic() < deadline, server.errors()
            time.sleep(0.01)
        server.signal(signal.SIGTERM)
        assert server.process.wait(timeout=5) == -signal.SIGTERM
    assert len(outbox(tmp_path)) < len(ADDRESSES)  # the queued emails are lost


IGNORE_DELAYS = """\
import pytest
import tickler


@pytest.fixture(autouse=True)
def ignore_delays(monkeypatch):
    enqueue = tickler.Service.enqueue_request

    def without_delay(self, request, *, key=None, delay=None):
        return enqueue(self, request, key=key)

    monkeypatch.setattr(tickler.Service, "enqueue_request", without_delay)
"""


def run_pytest(directory: Path) -> tuple[str, float]:
    """The page's pytest command in ``directory``: its output and its wall time."""
    started = time.monotonic()
    result = subprocess.run(  # noqa: S603 - this interpreter, running the page's command
        [*command("run-tests"), "-p", "no:cacheprovider"],
        cwd=directory,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return result.stdout + result.stderr, time.monotonic() - started


def test_the_handler_tests_pass_in_virtual_time(tmp_path: Path) -> None:
    """The page's tests pass, and a day of virtual time takes seconds of real time."""
    assert command("run-tests") == [sys.executable, "-m", "pytest", "test_welcome.py"]
    save(tmp_path, "test_welcome.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\nfilterwarnings = error\n")
    output, elapsed = run_pytest(tmp_path)
    assert re.search(r"=+ 3 passed in ", output), output
    assert elapsed < 10


def test_the_handler_tests_catch_a_wrong_policy_and_ignored_delays(tmp_path: Path) -> None:
    """Halve the backoff, and make tickler drop delays: every one of the page's tests fails."""
    code = BLOCKS["test_welcome.py"].code
    assert code.count("    initial=1.0,\n") == 1
    (tmp_path / "test_welcome.py").write_text(code.replace("initial=1.0,", "initial=0.5,"))
    (tmp_path / "conftest.py").write_text(IGNORE_DELAYS)
    (tmp_path / "pytest.ini").write_text("[pytest]\nfilterwarnings = error\n")
    output, _ = run_pytest(tmp_path)
    assert re.search(r"=+ 3 failed in ", output), output
