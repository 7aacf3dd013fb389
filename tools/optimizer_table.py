"""Writes docs/optimizers.md's table, every Keras optimizer with every option under each of tfdist's kinds, from a
test run's JUnit results: a cell says what its test shows (tests/optimizer_cells.py) only if that test passed.
`make test` checks the committed page against its own run.

    python tools/optimizer_table.py --junit .test-results/pytest.xml            # rewrite the table
    python tools/optimizer_table.py --junit .test-results/pytest.xml --check    # exit 1 if the page differs
"""

from __future__ import annotations

import os

from results_tables import ROOT, cell, main, render

import optimizer_cells as cells  # noqa: E402  (results_tables puts tests/ on the path)

PAGE = os.path.join(ROOT, "docs", "optimizers.md")
TOOL = "tools/optimizer_table.py"


def tables(results: dict[str, str]) -> dict[str, str]:
    lines = ["| optimizer | " + " | ".join(cells.KINDS) + " |", "|---" * (1 + len(cells.KINDS)) + "|"]
    lines += [f"| `{name}` | " + " | ".join(cell(cells.says(name, kind), cells.test_of(name, kind), results)
                                            for kind in cells.KINDS) + " |" for name in cells.OPTIMIZERS]
    return {"optimizers": "\n".join(lines)}


def render_page(page: str, results: dict[str, str]) -> str:
    """`page` with its table written from `results`."""
    return render(page, tables(results), TOOL)


if __name__ == "__main__":
    main(__doc__.splitlines()[0], PAGE, tables, TOOL)
