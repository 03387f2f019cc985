"""The house's shape, as the design page promises it: checked on the source, not by eye.

Each test reads tickler/ with ast: the import graph has no circle (imports
under TYPE_CHECKING included), no class chain is longer than Service ->
_Engine, one function at most is over 100 lines and none over 200, the two
SQL stores import nothing of each other, and the Prometheus collector reads
no private attribute of a service.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tickler
from tickler import _states

PACKAGE = Path(__file__).resolve().parent.parent / "tickler"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(("tickler", *parts)).removesuffix(".__init__")
        modules[name] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of tickler that ``name`` imports, anywhere in it (TYPE_CHECKING too)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            submodules = {f"{target}.{alias.name}" for alias in node.names} & modules.keys()
            # `from . import _lowlevel` imports the submodule, not the package's names.
            found.update((submodules or {target}) & modules.keys() - {name})
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of the graph, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state:
                found = visit(target, [*path, target])
                if found:
                    return found
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            found = visit(module, [module])
            if found:
                return found
    return None


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a"}}) is None


def test_no_import_circle_in_tickler() -> None:
    modules = _modules()
    # The package's own __init__ re-exports: every module may be reached from
    # it, and none imports it back (checked here too, as an edge like any other).
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _cycle(graph) is None


def _classes() -> dict[str, tuple[str, list[str]]]:
    """Every class of tickler: its module, and the names of its bases."""
    classes = {}
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(base).split("[")[0] for base in node.bases]
                classes[node.name] = (name, bases)
    return classes


def test_no_class_chain_longer_than_two() -> None:
    classes = _classes()

    def depth(name: str) -> int:
        bases = [b for b in classes[name][1] if b in classes]
        return 1 + max((depth(b) for b in bases), default=0)

    # Exception hierarchies are the public face of errors, not layers of state.
    deepest = {
        name: depth(name)
        for name, (module, _) in classes.items()
        if module != "tickler._exceptions"
    }
    assert deepest["Service"] == 2  # Service -> _Engine, and no more
    assert max(deepest.values()) <= 2, {n: d for n, d in deepest.items() if d > 2}


def test_function_lengths() -> None:
    long = {}
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > 100:
                    long[f"{name}.{node.name}"] = length
    # The processor loop, the per-request path kept in one frame (see its docstring).
    assert set(long) <= {"tickler._engine._process"}, long
    assert all(length <= 200 for length in long.values()), long


@pytest.mark.parametrize(("one", "other"), [("sqlite", "postgres"), ("postgres", "sqlite")])
def test_the_sql_stores_are_independent(one: str, other: str) -> None:
    modules = _modules()
    name = f"tickler._stores.{one}"
    imported = _imports(name, modules[name], modules)
    assert f"tickler._stores.{other}" not in imported
    assert "tickler._stores._pg_listen" not in imported or one == "postgres"
    other_classes = {
        node.name
        for node in ast.walk(ast.parse(modules[f"tickler._stores.{other}"].read_text()))
        if isinstance(node, ast.ClassDef)
    }
    for node in ast.walk(ast.parse(modules[name].read_text())):
        if isinstance(node, ast.ClassDef):
            assert not {ast.unparse(base) for base in node.bases} & other_classes


def test_prometheus_reads_no_private_attribute_of_a_service() -> None:
    tree = ast.parse((PACKAGE / "prometheus.py").read_text())
    private = [
        ast.unparse(node)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and not (isinstance(node.value, ast.Name) and node.value.id == "self")
    ]
    assert private == []
    imported = _imports("tickler.prometheus", PACKAGE / "prometheus.py", _modules())
    assert imported <= {"tickler"}, imported  # the package's public names only


def test_every_tuning_names_its_benchmark_row() -> None:
    tunings = [
        (path.name, line)
        for path in PACKAGE.rglob("*.py")
        for line in path.read_text().splitlines()
        if "# tuned" in line and "grep" not in line
    ]
    assert len(tunings) >= 10
    for where, line in tunings:
        assert "# tuned (bench: " in line, (where, line)


# What `import tickler` may not load: the stores, the admin, the web app, the CLI,
# tracing and metrics, and the libraries they stand on.
_NOT_AT_IMPORT = (
    "sqlite3",
    "psycopg",
    "starlette",
    "opentelemetry",
    "prometheus_client",
    "tickler._stores.sqlite",
    "tickler._stores.postgres",
    "tickler._stores._admin",
    "tickler._stores._sql",
    "tickler.web",
    "tickler.otel",
    "tickler.prometheus",
    "tickler.__main__",
)


def _fresh(code: str) -> str:
    done = subprocess.run(  # noqa: S603  # this interpreter, with code of this file
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        stdin=subprocess.DEVNULL,
    )
    return done.stdout


def test_import_tickler_loads_the_core_only() -> None:
    loaded = _fresh(
        f"import sys, tickler\nprint(' '.join(m for m in {_NOT_AT_IMPORT!r} if m in sys.modules))\n"
    )
    assert loaded.split() == []


def test_the_lazy_names_load_on_first_use() -> None:
    out = _fresh(
        "import sys, tickler\n"
        "print(tickler.SqliteStore.__module__, 'sqlite3' in sys.modules)\n"
        "from tickler import *\n"
        "print(sorted(tickler.__all__) == sorted(n for n in dir() if n in tickler.__all__))\n"
        "print(set(tickler.__all__) <= set(dir(tickler)))\n"
        "print(tickler.Admin.__name__, tickler.PostgresStore.__name__)\n"
    )
    assert out.split("\n")[:4] == [
        "tickler._stores.sqlite True",
        "True",
        "True",
        "Admin PostgresStore",
    ]
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        tickler.NoSuchName  # type: ignore[attr-defined]  # noqa: B018


# -- the request states: one table (tickler/_states.py), read by every part

# What a quoted word in SQL that names a state may also be: the reasons of a rescue
# (see tickler/_stores/_sql.py), the other labels of a queue's counts ('paused',
# 'rescued_' and a reason), and SQLite's 'now'.
_NOT_STATES = {"owner_died", "lease_lapsed", "paused", "rescued_", "now"}
_NAMED_SETS = {
    "LIVE": _states.LIVE,
    "READY": _states.READY,
    "FINAL": _states.FINAL,
    "ENDED": _states.ENDED,
    "RETRYABLE": _states.RETRYABLE,
}
_IN_LIST = re.compile(r"\bstate\s+(?:NOT\s+)?IN\s*\(([^)]*)\)", re.IGNORECASE)
_OR_LIST = re.compile(r"\((state = '\w+'(?: OR state = '\w+')+)\)")


def _sql_strings() -> list[tuple[str, int, str]]:
    """(file, line, text) of each string of tickler's source that mentions a state column:
    SQL, or a part of an f-string of SQL."""
    return [
        (str(path.relative_to(PACKAGE)), node.lineno, node.value)
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "_states.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and re.search(r"\bstate\b", node.value)
    ]


def _templates() -> list[tuple[str, str]]:
    return [
        (path.name, path.read_text()) for path in sorted((PACKAGE / "web" / "templates").glob("*"))
    ]


def test_the_table_of_states() -> None:
    assert tuple(status.value for status in tickler.Status) == _states.STATES
    assert tickler.Status is _states.Status
    states = set(_states.STATES)
    for name, named in _NAMED_SETS.items():
        assert set(named) <= states, name
        assert len(set(named)) == len(named), name
        assert list(named) == [s for s in _states.STATES if s in named], f"{name}: in life order"
    assert set(_states.LIVE) | set(_states.FINAL) == states
    assert not set(_states.LIVE) & set(_states.FINAL)
    assert set(_states.READY) == set(_states.LIVE) - {"running"}
    assert set(_states.ENDED) | set(_states.RETRYABLE) == set(_states.FINAL)
    assert _states.CLAIMED not in states
    assert [s for s in _states.COUNTED if s != _states.CLAIMED] == list(_states.STATES)
    assert {tickler.Status(s) for s in _states.FINAL} == _states.FINAL_STATUSES
    assert _states.sql_in(_states.FINAL) == "state IN ('succeeded', 'failed', 'cancelled')"
    assert _states.sql_in(["running"]) == "state = 'running'"
    assert _states.sql_any(_states.READY) == (
        "(state = 'queued' OR state = 'scheduled' OR state = 'retrying')"
    )
    with pytest.raises(ValueError, match="'canceled' is not a state of tickler"):
        _states.sql_in(["canceled"])


def test_every_state_in_sql_is_a_state_of_the_table() -> None:
    """Each quoted word of SQL that mentions ``state`` is a state of tickler/_states.py (or
    "claimed", or one of the few other words that SQL quotes); each list of states it
    tests against is a named set, written as the table renders it. The partial indexes'
    predicates stay literal (their text is the schema's), and so are checked here."""
    allowed = {*_states.STATES, _states.CLAIMED, *_NOT_STATES}
    named = {tuple(states): name for name, states in _NAMED_SETS.items()}
    strays = []
    for where, line, text in _sql_strings():
        strays += [
            f"{where}:{line}: {word!r}"
            for word in re.findall(r"'([A-Za-z_]+)'", text)
            if word not in allowed
        ]
        for match in _IN_LIST.finditer(text):
            listed = tuple(re.findall(r"'([A-Za-z_]+)'", match.group(1)))
            if listed not in named or match.group(1) != _states.sql_in(listed)[10:-1]:
                strays.append(f"{where}:{line}: {match.group(0)} is not a named set's SQL")
        for match in _OR_LIST.finditer(text):
            listed = tuple(re.findall(r"'([A-Za-z_]+)'", match.group(1)))
            if listed not in named or match.group(0) != _states.sql_any(listed):
                strays.append(f"{where}:{line}: {match.group(0)} is not a named set's SQL")
    assert strays == []


def test_every_state_in_a_template_is_a_state_of_the_table() -> None:
    states = set(_states.STATES)
    strays = []
    for name, text in _templates():
        words = re.findall(r"\bstate\s*[!=]=\s*\"(\w+)\"", text)
        for listed in re.findall(r"\bstate\s+(?:not\s+)?in\s*\(([^)]*)\)", text):
            words += re.findall(r"\"(\w+)\"", listed)
        strays += [f"{name}: {word!r}" for word in words if word not in states]
    assert strays == []
    # The named sets the templates test against are the table's.
    from tickler.web._app import _environment

    environment = _environment()
    for name in ("live", "ready", "final", "retryable"):
        assert environment.globals[name] == _NAMED_SETS[name.upper()]


def test_the_scans_see_the_stores_sql() -> None:
    """The scans above are not vacuous: they see the states the stores write."""
    texts = " ".join(text for _, _, text in _sql_strings())
    for state in _states.STATES:
        assert f"'{state}'" in texts
    assert any(_IN_LIST.search(text) for _, _, text in _sql_strings())
