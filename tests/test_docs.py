"""README.md and docs/: every code block is named, every Python block runs; and the demo.

Each fenced block on a page carries its name in the ``<!-- example: NAME -->``
line just above its fence, and the tests find it by that name (on its page),
never by its position. A block without a name fails the suite. Every Python
block runs here, in a subprocess, and must print what ``OUTPUTS`` says, but
for docs/recipes.md's, which tests/test_recipes.py saves as files and runs
with real servers. Shell, console, SQL and text blocks are shown, not run;
the README's setup commands and the SQLite page's INSERT are checked below.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import re
import shlex
import sqlite3
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import attrs
import pytest
import trio

import demo
import tickler

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MARKER = re.compile(r"<!-- example: (\S+) -->")
FENCE = "```"
LANGUAGES = {"python", "sh", "console", "sql", "text"}


@attrs.frozen
class Block:
    language: str
    code: str


def read_blocks(text: str) -> dict[str, Block]:
    """Every fenced block of ``text`` by the name in the marker line just above it.

    A block without a marker, or a name given twice, raises ``ValueError``:
    no block can escape the tests. A block indented under a list item loses
    its fence's indentation.
    """
    blocks: dict[str, Block] = {}
    lines = text.splitlines(keepends=True)
    name: str | None = None
    index = 0
    while index < len(lines):
        line = lines[index]
        index += 1
        if not line.lstrip().startswith(FENCE):
            marker = MARKER.fullmatch(line.strip())
            name = marker[1] if marker is not None else None
            continue
        if name is None:
            raise ValueError(f"line {index}: a code block without a name")
        if name in blocks:
            raise ValueError(f"two blocks named {name!r}")
        start = index
        while lines[index].strip() != FENCE:
            index += 1
        code = textwrap.dedent("".join(lines[start:index]))
        blocks[name] = Block(line.strip().removeprefix(FENCE), code)
        index += 1
        name = None
    return blocks


def page_name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


BLOCKS: dict[str, dict[str, Block]] = {}
UNNAMED: dict[str, str] = {}
for _path in PAGES:
    try:
        BLOCKS[page_name(_path)] = read_blocks(_path.read_text())
    except ValueError as _error:
        UNNAMED[page_name(_path)] = str(_error)

# What each Python block prints, by its page and name.
OUTPUTS = {
    ("README.md", "send-email"): "sent to user0@example.com\n20\n",
    ("docs/tutorial.md", "start-join-stop"): (
        "['resized photo0.jpg', 'resized photo1.jpg', 'resized photo2.jpg',"
        " 'resized photo3.jpg']\n[]\n4 True\n"
    ),
    ("docs/tutorial.md", "keys-and-delays"): (
        "True SCHEDULED\n30 s: reminder for grace\n60 s: reminder for ada\n1\n"
    ),
    ("docs/tutorial.md", "a-full-queue"): (
        "upload 2 refused: the queue is full\nupload 3 refused: the queue is full\n"
        "upload 4 accepted as request #3\n3 2\n"
    ),
    ("docs/reference.md", "submit-from-a-thread"): "50\n50 0\n",
    ("docs/failures.md", "retry"): "delivered 'hello' on attempt 3\n2\n",
    ("docs/failures.md", "follow-up-with-a-key"): "['create 1', 'create 1', 'start 1']\n1\n",
    ("docs/stores/sqlite.md", "invoice"): "1 invoice for order 42\n1\n",
    ("docs/stores/writing-a-store.md", "one-batch"): (
        "[True, True]\n[(b'1', 1, None), (b'2', 1, None)]\n['succeeded', 'succeeded']\n"
    ),
    ("docs/scheduling.md", "priorities"): (
        "['password reset', 'receipt', 'invoice', 'newsletter']\n"
    ),
    ("docs/scheduling.md", "enqueue-many"): "200000 1 200000\nTrue 2\n200002\n",
    ("docs/scheduling.md", "enqueue-many-in"): "5000 [1, 2, 3]\n5000\n",
    ("docs/scheduling.md", "unique-for"): "True SUCCEEDED\n['ada']\n",
    ("docs/scheduling.md", "periodic"): "60 {60}\n",
    ("docs/limits.md", "mail-provider"): "acme 30 sends over 2.0 s\ntiny 1 sends over 0.0 s\n",
    ("docs/limits.md", "one-step-at-a-time"): (
        "0s - audit entry\n0s blog create\n0s shop create\n1s blog dns\n1s shop dns\n"
        "2s blog tls\n2s shop tls\n"
    ),
    ("docs/operating.md", "admin-api"): (
        "['mail']\nTrue True\n2\n"
        "[(3, 'queued', 'c@example.com'), (2, 'cancelled', 'b@example.com')] 2\n"
        "[(1, 'cancelled')] None\nTrue\n1\n3 1\n3\n"
    ),
    ("docs/dashboard.md", "mount"): "['/tickler']\n",
    ("docs/observability.md", "prometheus"): (
        'tickler_requests_succeeded_total{service="mailer"} 3.0\n'
    ),
    ("docs/observability.md", "otel-trace"): (
        "POST /signup\n  send mail\n    process mail retrying\n    process mail succeeded\n"
        "1 trace\n"
    ),
    ("docs/observability.md", "otel-enqueue-in"): (
        "POST /orders\n  send invoices\n    process invoices succeeded\n1 trace\n"
    ),
}
# The Python blocks that tests/test_recipes.py saves as files and runs.
RECIPES = {("docs/recipes.md", name) for name in ("app.py", "serve.py", "test_welcome.py")}


def test_every_block_is_named() -> None:
    """Each page's code blocks have names, given once; a page without them fails here."""
    assert UNNAMED == {}
    with pytest.raises(ValueError, match="without a name"):
        read_blocks("Text.\n\n```python\npass\n```\n")
    with pytest.raises(ValueError, match="two blocks named 'a'"):
        read_blocks("<!-- example: a -->\n```sh\nls\n```\n<!-- example: a -->\n```sh\nls\n```\n")
    assert read_blocks("- item:\n\n  <!-- example: b -->\n  ```sql\n  SELECT 1\n  ```\n") == {
        "b": Block("sql", "SELECT 1\n")
    }


def test_every_python_block_is_run() -> None:
    """The Python blocks are exactly the ones run below or by tests/test_recipes.py."""
    found = {
        (page, name)
        for page, blocks in BLOCKS.items()
        for name, block in blocks.items()
        if block.language == "python"
    }
    assert found == set(OUTPUTS) | RECIPES
    languages = {block.language for blocks in BLOCKS.values() for block in blocks.values()}
    assert languages <= LANGUAGES  # a ```py block would escape the runs


@pytest.mark.parametrize(("page", "name"), sorted(OUTPUTS), ids="::".join)
def test_python_block_prints_what_it_shows(tmp_path: Path, page: str, name: str) -> None:
    """The block runs as written, in a directory of its own, and prints what it shows."""
    result = subprocess.run(  # noqa: S603 - our own interpreter on our own docs
        [sys.executable, "-c", BLOCKS[page][name].code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == OUTPUTS[page, name]


def test_the_operating_page_shows_what_its_blocks_print(tmp_path: Path) -> None:
    """docs/operating.md: the admin block's output as shown, then each command of its
    console block, run as a real process in the same directory, prints what it shows."""
    blocks = BLOCKS["docs/operating.md"]
    assert blocks["admin-api-output"].code == OUTPUTS["docs/operating.md", "admin-api"]
    subprocess.run(  # noqa: S603 - our own interpreter on our own docs
        [sys.executable, "-c", blocks["admin-api"].code],
        cwd=tmp_path,
        capture_output=True,
        check=True,
        timeout=60,
    )
    steps: list[tuple[str, list[str]]] = []
    for line in blocks["cli"].code.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        else:
            steps[-1][1].append(line)
    assert len(steps) == 4
    for command, shown in steps:
        words = shlex.split(command)
        assert words[:3] == ["python", "-m", "tickler"]
        result = subprocess.run(  # noqa: S603 - our own interpreter on our own docs
            [sys.executable, *words[1:]],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
        assert result.stderr == ""
        assert result.stdout.splitlines() == shown, command


def test_readme_is_a_front_door() -> None:
    """At most 300 lines, with one Python example; the rest lives on six pages or more."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300
    readme = BLOCKS["README.md"]
    assert [name for name, block in readme.items() if block.language == "python"] == ["send-email"]
    assert len([page for page in BLOCKS if page.startswith("docs/")]) >= 6


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    found: set[str] = set()
    for line in re.sub(r"^ *```.*?^ *```", "", text, flags=re.M | re.S).splitlines():
        if heading := re.match(r"#{1,6} (.*)", line):
            base = anchor = slug(heading[1])
            number = 0
            while anchor in found:
                number += 1
                anchor = f"{base}-{number}"
            found.add(anchor)
    return found


def links(text: str) -> list[str]:
    """The targets of the page's Markdown links, outside code."""
    prose = re.sub(r"^ *```.*?^ *```", "", text, flags=re.M | re.S)
    prose = re.sub(r"`[^`]*`", "", prose)
    return re.findall(r"\]\(([^)\s]+)\)", prose)


@pytest.mark.parametrize("path", PAGES, ids=page_name)
def test_links_reach_their_pages_and_headings(path: Path) -> None:
    """Every relative link names a file that exists, and a heading of it that exists."""
    for target in links(path.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        assert linked.exists(), f"{page_name(path)}: {target}"
        if anchor:
            assert anchor in anchors(linked.read_text()), f"{page_name(path)}: {target}"


def test_readme_says_how_a_user_installs_each_extra() -> None:
    """The install block names this distribution, and only extras it has."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "trio-tickler"  # "tickler" on PyPI is another project
    section = (ROOT / "README.md").read_text().split("## Install\n", 1)[1].split("\n## ", 1)[0]
    block = BLOCKS["README.md"]["install"]
    assert block.language == "sh"
    assert f"<!-- example: install -->\n```sh\n{block.code}```\n" in section
    installs = [line.split("#")[0].split()[-1].strip("'") for line in block.code.splitlines()]
    assert installs == [
        "trio-tickler",
        "trio-tickler[postgres]",
        "trio-tickler[prometheus]",
        "trio-tickler[cron]",
        "trio-tickler[web]",
        "trio-tickler[otel]",
    ]
    extras = set(project["optional-dependencies"])
    installed = set(importlib.metadata.metadata("trio-tickler").get_all("Provides-Extra") or ())
    for name in installs[1:]:
        extra = name.split("[")[1].rstrip("]")
        assert extra in extras
        assert extra in installed
    assert "pip install '.[postgres,prometheus,cron,web,otel]'" in section


COMMANDS = [
    "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/python demo.py",
    "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/python -m pytest",
]


def test_readme_gives_the_two_setup_commands() -> None:
    """The README's commands are the ones .ci/run executes."""
    readme = BLOCKS["README.md"]
    demo_command, test_command = readme["run-the-demo"], readme["run-the-tests"]
    assert (demo_command.language, test_command.language) == ("sh", "sh")
    assert [demo_command.code, test_command.code] == [f"{command}\n" for command in COMMANDS]
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    for step in COMMANDS[1].split(" && "):  # CI runs the test command step by step
        assert step in ci_lines


async def double(number: int) -> int:
    await trio.sleep(0)
    return 2 * number


async def test_the_sqlite_pages_insert_for_other_drivers(tmp_path: Path) -> None:
    """docs/stores/sqlite.md's INSERT, run through sqlite3, makes a request the service runs."""
    insert = BLOCKS["docs/stores/sqlite.md"]["insert-from-another-driver"]
    assert insert.language == "sql"
    store = tickler.SqliteStore(tmp_path / "queue.db", poll_interval=0.05)
    async with tickler.open_service(double, store=store, name="jobs") as service:
        connection = sqlite3.connect(store.path)
        with connection:
            connection.execute(insert.code, {"queue": "jobs", "request": b"21"})
        connection.close()
        with trio.fail_after(10):
            while (found := await service.lookup(1)) is None or not found.done:
                await trio.sleep(0.02)
        assert found.result() == 42


async def test_demo_runs_the_dance(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """The demo drains everything it sends and shows the limit being reached."""
    caplog.set_level("DEBUG", logger="tickler")
    stats = (await demo.main(capacity=3, requests=10, burst=8, seed=3)).statistics
    assert (stats.enqueued, stats.succeeded) == (18, 18)
    assert stats.peak_queued >= 5
    messages = [r.getMessage() for r in caplog.records if r.name == "tickler"]
    assert any(m.startswith("received loop signal, but request limit is reached") for m in messages)
    assert trio.current_time() < 10


def test_demo_arguments() -> None:
    """The demo takes --capacity, --requests, --burst and --seed."""
    args = demo.parse_args(["--capacity", "2", "--requests", "5", "--burst", "4", "--seed", "9"])
    assert (args.capacity, args.requests, args.burst, args.seed) == (2, 5, 4, 9)
    assert demo.parse_args([]).capacity == 3


# -- Documented signatures: what the pages say each call takes is what it takes

# A documented signature is a code span ``[await ]OBJECT(PARAMETERS)[ -> RETURNED]``, where
# OBJECT is ``tickler.…`` or a method of ``service.``, ``store.``, ``admin.`` or ``ticket.``,
# that stands in a heading, or lists a ``*`` among its parameters, or gives ``-> `` what it
# returns. It names every parameter, in order, each with its default, unless ``...``
# stands among them for those it leaves out. Any other such span is a call or a mention.
SIGNATURE = re.compile(
    r"(?:await )?(?P<object>(?:tickler|service|store|admin|ticket)(?:\.\w+)+)"
    r"\((?P<parameters>.*)\)(?P<returns> -> .+)?",
    re.S,
)
# What each page's ``store.`` is.
STORES: dict[str, list[object]] = {
    "docs/stores/sqlite.md": [tickler.SqliteStore],
    "docs/stores/postgres.md": [tickler.PostgresStore],
}


@attrs.frozen
class Documented:
    page: str
    text: str
    objects: list[object]
    parameters: list[str]


def split_parameters(text: str) -> list[str]:
    """The parameters of a signature's text, split at its top-level commas."""
    found, depth, start, quote = [], 0, 0, ""
    for index, char in enumerate(text):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            found.append(text[start:index].strip())
            start = index + 1
    last = text[start:].strip()
    return [*found, last] if last or found else []


def resolve(page: str, name: str) -> list[object]:
    """The objects a documented name stands for (a page's ``store.`` may be either)."""
    import importlib

    head, *path = name.split(".")
    owners: list[object]
    if head == "tickler":
        # The longest importable module first: tickler.web.serve is tickler.web's serve.
        for size in range(len(path), -1, -1):
            try:
                owners = [importlib.import_module(".".join(["tickler", *path[:size]]))]
            except ImportError:
                continue
            path = path[size:]
            break
    elif head == "store":
        owners = STORES.get(page, [tickler.SqliteStore, tickler.PostgresStore])
    else:
        owners = [
            {"service": tickler.Service, "admin": tickler.Admin, "ticket": tickler.Ticket}[head]
        ]
    found = []
    for owner in owners:
        for part in path:
            owner = getattr(owner, part)
        found.append(owner)
    return found


def documented_signatures() -> list[Documented]:
    found = []
    for path in PAGES:
        page = page_name(path)
        prose = re.sub(r"^ *```.*?^ *```", "", path.read_text(), flags=re.M | re.S)
        for span in re.finditer(r"`([^`]+)`", prose):
            text = " ".join(span[1].split())
            match = SIGNATURE.fullmatch(text)
            if match is None:
                continue
            line_start = prose.rfind("\n", 0, span.start()) + 1
            heading = prose[line_start:].startswith("#")
            parameters = split_parameters(match["parameters"])
            starred = any(p.startswith("*") for p in parameters)
            if heading or starred or match["returns"]:
                found.append(Documented(page, text, resolve(page, match["object"]), parameters))
    return found


def signature_errors(documented: Documented, real: inspect.Signature) -> list[str]:
    """How the documented parameters differ from ``real``'s (none: they agree)."""
    import ast

    kinds = inspect.Parameter
    actual = [p for p in real.parameters.values() if p.name not in ("self", "cls")]
    errors: list[str] = []
    listed: list[tuple[str, inspect._ParameterKind, object]] = []  # (name, kind, default)
    keyword_only = False
    for text in documented.parameters:
        if text == "...":
            continue
        if text == "*":
            keyword_only = True
            continue
        if text.startswith("**"):
            listed.append((text[2:], kinds.VAR_KEYWORD, kinds.empty))
            continue
        if text.startswith("*"):
            listed.append((text[1:], kinds.VAR_POSITIONAL, kinds.empty))
            keyword_only = True
            continue
        name, equals, default = text.partition("=")
        value: object = kinds.empty
        if equals:
            try:
                value = ast.literal_eval(default.strip())
            except ValueError:
                errors.append(f"{name.strip()}: default {default.strip()} is not a literal")
                continue
        kind = kinds.KEYWORD_ONLY if keyword_only else kinds.POSITIONAL_OR_KEYWORD
        listed.append((name.strip(), kind, value))
    by_name = {p.name: p for p in actual}
    for name_of, kind_of, default_of in listed:
        parameter = by_name.get(name_of)
        if parameter is None:
            errors.append(f"{name_of}: no such parameter")
            continue
        real_kind = (
            kinds.POSITIONAL_OR_KEYWORD
            if parameter.kind is kinds.POSITIONAL_ONLY
            else parameter.kind
        )
        if real_kind is not kind_of:
            errors.append(f"{name_of}: documented {kind_of}, is {parameter.kind}")
        real_default = parameter.default
        if (type(default_of), default_of) != (type(real_default), real_default):
            shown = "none" if default_of is kinds.empty else repr(default_of)
            errors.append(f"{name_of}: documented default {shown}, is {real_default!r}")
    names = [name for name, _, _ in listed]
    positional = [
        p.name for p in actual if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
    ]
    documented_positional = [
        name for name, kind, _ in listed if kind is kinds.POSITIONAL_OR_KEYWORD
    ]
    if "..." not in documented.parameters:
        missing = [p.name for p in actual if p.name not in names]
        if missing:
            errors.append(f"leaves out {', '.join(missing)}")
        if documented_positional != positional:
            errors.append(f"positional parameters {documented_positional}, are {positional}")
    elif documented_positional != [n for n in positional if n in documented_positional]:
        errors.append(f"positional parameters out of order: {documented_positional}")
    return errors


def test_signature_errors_find_each_kind_of_drift() -> None:
    """The comparison itself: a left-out keyword, a wrong default, a wrong kind, a name
    that is not there; and ``...`` lets a page leave parameters out."""

    def f(a: int, *, b: int = 1, c: str = "x") -> None: ...

    def check(text: str) -> list[str]:
        return signature_errors(
            Documented("p", text, [f], split_parameters(text)), inspect.signature(f)
        )

    assert check("a, *, b=1, c='x'") == []
    assert check("a, *, b=1, ...") == []
    assert check("a, *, b=1") == ["leaves out c"]
    assert check("a, *, b=2, c='x'") == ["b: documented default 2, is 1"]
    assert check("a, *, b=True, c='x'") == ["b: documented default True, is 1"]
    assert check("a, b=1, c='x'") == [
        "b: documented POSITIONAL_OR_KEYWORD, is KEYWORD_ONLY",
        "c: documented POSITIONAL_OR_KEYWORD, is KEYWORD_ONLY",
        "positional parameters ['a', 'b', 'c'], are ['a']",
    ]
    assert check("x, *, b=1, c='x'") == [
        "x: no such parameter",
        "leaves out a",
        "positional parameters ['x'], are ['a']",
    ]


def test_each_documented_signature_is_the_real_one() -> None:
    """Every signature on every page names the parameters the object takes, with their
    kinds and defaults (see SIGNATURE for what counts as one)."""
    found = documented_signatures()
    texts = {d.text for d in found}
    # The scan finds them: among others, each page's signatures of the enqueue calls.
    for expected in (
        "service.enqueue_request(",
        "await service.submit(",
        "service.enqueue_many(",
        "service.stop(",
        "tickler.Service(",
        "tickler.PostgresStore(",
        "tickler.SqliteStore(",
        "tickler.web.serve(",
        "tickler.web.app(",
    ):
        assert any(text.startswith(expected) for text in texts), expected
    pages_with_enqueue_in = {d.page for d in found if d.text.startswith("store.enqueue_in(")}
    assert {"docs/stores/sqlite.md", "docs/stores/postgres.md"} <= pages_with_enqueue_in
    assert any(
        d.page == "docs/scheduling.md" and d.text.startswith("store.enqueue_many_in(")
        for d in found
    )
    wrong = {
        f"{d.page}: {d.text}: {error}"
        for d in found
        for real in d.objects
        for error in signature_errors(d, inspect.signature(real))  # type: ignore[arg-type]
    }
    assert sorted(wrong) == []


# -- Documented metrics: the table of docs/observability.md is what the collector exports


def documented_metrics() -> dict[str, set[str]]:
    """Each metric of the table, by its full name, with the values of its label (empty
    for a metric without one): the ``tickler_…`` names of a row's first cell, the label
    values being the row's other code spans."""
    text = (ROOT / "docs" / "observability.md").read_text()
    table = text.split("| metric | type | meaning |", 1)[1].split("\n\n", 1)[0]
    found: dict[str, set[str]] = {}
    for row in table.splitlines()[2:]:
        first, _, meaning = row.strip("|").partition("|")
        labelled = "{" in first
        values = set(re.findall(r"`([a-z_]+)`", meaning)) if labelled else set()
        for name in re.findall(r"`(tickler_[a-z_]+)", first):
            found[name] = values
    return found


def exported_metrics(samples: list[tuple[str, dict[str, str]]]) -> dict[str, set[str]]:
    """The same of what the collector exported (its histograms by their family's name)."""
    found: dict[str, set[str]] = {}
    for name, labels in samples:
        family = re.sub(r"_(bucket|count|sum)$", "", name)
        values = found.setdefault(family, set())
        values.update(value for label, value in labels.items() if label not in ("service", "le"))
    return found


async def test_each_documented_metric_is_exported(tmp_path: Path) -> None:
    """A service on a store, after it ran requests: the table of docs/observability.md
    names every metric it exports and no other, with every value of each label; and the
    series of the page's /metrics example are the ones exported."""
    pytest.importorskip("prometheus_client")
    import prometheus_client

    import tickler.prometheus

    store = tickler.SqliteStore(tmp_path / "queue.db", poll_interval=0.05)
    async with tickler.open_service(double, store=store, name="jobs") as service:
        for number in range(3):
            await service.submit(number)
        await service.join()
        registry = prometheus_client.CollectorRegistry()
        registry.register(tickler.prometheus.Collector(service))
        families = await trio.to_thread.run_sync(lambda: list(registry.collect()))
    samples = [(s.name, dict(s.labels)) for f in families for s in f.samples]
    assert documented_metrics() == exported_metrics(samples)
    shown = BLOCKS["docs/observability.md"]["metrics-from-site-manager"].code
    series = shown.split("\n$ ", 1)[0].splitlines()[1:]
    documented = {
        (line.split("{")[0], tuple(sorted(re.findall(r'(\w+)="([^"]*)"', line)))) for line in series
    }
    exported = {
        (name, tuple(sorted({**labels, "service": "site_manager"}.items())))
        for name, labels in samples
        if not name.endswith("_bucket")
    }
    assert documented == exported


def test_readme_lists_each_page_once() -> None:
    """The README's list of pages names each page once."""
    listed = re.findall(r"^- \[[^\]]+\]\((docs/[^)#]+)\)", (ROOT / "README.md").read_text(), re.M)
    assert listed
    assert sorted(listed) == sorted(set(listed))


_MODULE_ROW = re.compile(r"^\| `(tickler/[\w/]+\.py)` \| (\d+) \|", re.MULTILINE)
_NAMED_FILE = re.compile(r"`(tickler/[\w/]+\.py)`")


def test_the_design_page_names_every_module_with_its_size() -> None:
    """design.md's table of modules names each module of tickler/ once, each with its
    size within 15% (or 20 lines) of the file's; its table of owners names only files
    that exist."""
    page = (ROOT / "docs" / "design.md").read_text()
    listed = {path: int(lines) for path, lines in _MODULE_ROW.findall(page)}
    assert len(listed) == len(_MODULE_ROW.findall(page)), "a module is listed twice"
    modules = {path.relative_to(ROOT).as_posix() for path in (ROOT / "tickler").rglob("*.py")}
    assert sorted(modules - listed.keys()) == [], "modules the design page does not list"
    assert sorted(listed.keys() - modules) == [], "the design page lists files that are gone"
    for path, lines in listed.items():
        actual = len((ROOT / path).read_text().splitlines())
        assert abs(actual - lines) <= max(20, 0.15 * actual), (path, lines, actual)
    owners = page[page.index("## Which file owns what") : page.index("## Every module")]
    for path in _NAMED_FILE.findall(owners):
        assert (ROOT / path).is_file(), path
