"""The house's shape, as the design page promises it: checked on the source, not by eye.

Each test reads tickler/ with ast: the import graph has no circle (imports
under TYPE_CHECKING included), no class chain is longer than Service ->
_Engine, one function at most is over 100 lines and none over 200, the two
SQL stores import nothing of each other, and the Prometheus collector reads
no private attribute of a service.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import tickler

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
