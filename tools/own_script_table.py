"""Writes the two tables of docs/own-script.md, the guide scripts under each kind and launched as jobs, from a
test run's JUnit results: a cell says what its test shows (tests/own_script_cells.py) only if that test passed,
else "failed", "skipped" or "not run". `make test` checks the committed page against its own run.

    python tools/own_script_table.py --junit .test-results/pytest.xml            # rewrite the tables
    python tools/own_script_table.py --junit .test-results/pytest.xml --check    # exit 1 if the page differs
"""

from __future__ import annotations

import os

from results_tables import ROOT, cell, main, render

import own_script_cells as cells  # noqa: E402  (results_tables puts tests/ on the path)

PAGE = os.path.join(ROOT, "docs", "own-script.md")
TOOL = "tools/own_script_table.py"


def kinds_table(results: dict[str, str]) -> str:
    by_script = {}
    for script, kind, says, test in cells.kind_cells():
        by_script.setdefault(script, []).append(cell(says, test, results))
    lines = ["| script | " + " | ".join(cells.KINDS) + " |", "|---" * (1 + len(cells.KINDS)) + "|"]
    lines += [f"| `examples/{script}` | " + " | ".join(row) + " |" for script, row in by_script.items()]
    return "\n".join(lines)


def launched_table(results: dict[str, str]) -> str:
    lines = ["| script | launched as | result |", "|---|---|---|"]
    lines += [f"| `examples/{script}` | {job} | {cell(says, test, results)} |"
              for script, job, says, test in cells.launched_cells()]
    return "\n".join(lines)


def tables(results: dict[str, str]) -> dict[str, str]:
    return {"kinds": kinds_table(results), "launched": launched_table(results)}


def render_page(page: str, results: dict[str, str]) -> str:
    """`page` with its tables written from `results`."""
    return render(page, tables(results), TOOL)


if __name__ == "__main__":
    main(__doc__.splitlines()[0], PAGE, tables, TOOL)
