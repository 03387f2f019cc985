"""The benchmark table: its rows, their ratios and targets, and its Markdown.

Both halves of the benchmark build their rows from here, bench/run.py (the
in-memory and SQLite rows, and the command) and bench/postgres.py (the
PostgreSQL rows), so that imports run one way: run -> postgres -> _table.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass
class Row:
    """One line of the table: a variant's samples, and what it is compared with."""

    key: str
    workload: str
    variant: str
    samples: list[float]
    unit: str
    baseline: str | None = None  # the key of the row this one is divided by
    target: tuple[str, str, float] | None = None  # ("ratio" | "value", ">=" | "<=", bound)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)


def ratio(row: Row, rows: dict[str, Row]) -> float | None:
    """The row's median over its baseline's median, when both were measured."""
    base = rows.get(row.baseline) if row.baseline else None
    if base is None or not row.samples or not base.samples:
        return None
    return row.median / base.median


def verdict(row: Row, rows: dict[str, Row]) -> str:
    """'met', 'MISSED' or 'not measured' for a row with a target; '' without one."""
    if row.target is None:
        return ""
    kind, op, bound = row.target
    value = ratio(row, rows) if kind == "ratio" else (row.median if row.samples else None)
    if value is None:
        return "not measured"
    met = value >= bound if op == ">=" else value <= bound
    return "met" if met else "MISSED"


def markdown(table: list[Row]) -> list[str]:
    """The table's lines in Markdown, one per row in order, after its header."""
    rows = {row.key: row for row in table}
    lines = [
        "| workload | variant | median | unit | ratio | target | status |",
        "|---|---|---:|---|---|---|---|",
    ]
    for row in table:
        median = "skipped" if not row.samples else f"{row.median:,.{3 if row.median < 10 else 0}f}"
        r = ratio(row, rows)
        base = rows[row.baseline].variant if row.baseline else ""
        ratio_text = "" if r is None else f"{r:.2f}x {base}"
        target = ""
        if row.target is not None:
            kind, op, bound = row.target
            target = f"{op} {bound:g}{'x' if kind == 'ratio' else ' ' + row.unit}"
        lines.append(
            f"| {row.workload} | {row.variant} | {median} | {row.unit} | {ratio_text} |"
            f" {target} | {verdict(row, rows)} |"
        )
    return lines
