"""Writes the two tables of docs/own-script.md, the guide scripts under each kind and launched as jobs, from a
test run's JUnit results: a cell says what its test shows (tests/own_script_cells.py) only if that test passed,
else "failed", "skipped" or "not run". `make test` checks the committed page against its own run.

    python tools/own_script_table.py --junit .test-results/pytest.xml            # rewrite the tables
    python tools/own_script_table.py --junit .test-results/pytest.xml --check    # exit 1 if the page differs
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
import xml.etree.ElementTree as ElementTree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "own-script.md")
sys.path.insert(0, os.path.join(ROOT, "tests"))

import own_script_cells as cells  # noqa: E402

BEGIN, END = "<!-- {}: written by tools/own_script_table.py from the test results -->", "<!-- end of {} -->"


def test_results(junit: str) -> dict[str, str]:
    """Test id ("tests/a/test_b.py::name[params]") -> "passed", "failed" or "skipped", from a JUnit XML file."""
    results = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        tags = {child.tag for child in case}
        status = "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
        name = re.sub(r"@\w+$", "", case.get("name"))  # pytest-xdist's group of a test that has one
        results[f"{case.get('classname').replace('.', '/')}.py::{name}"] = status
    return results


def _cell(says: str, test: str, results: dict[str, str]) -> str:
    status = results.get(test, "not run")
    return says if status == "passed" else f"**{status}**"


def kinds_table(results: dict[str, str]) -> str:
    by_script = {}
    for script, kind, says, test in cells.kind_cells():
        by_script.setdefault(script, []).append(_cell(says, test, results))
    lines = ["| script | " + " | ".join(cells.KINDS) + " |", "|---" * (1 + len(cells.KINDS)) + "|"]
    lines += [f"| `examples/{script}` | " + " | ".join(row) + " |" for script, row in by_script.items()]
    return "\n".join(lines)


def launched_table(results: dict[str, str]) -> str:
    lines = ["| script | launched as | result |", "|---|---|---|"]
    lines += [f"| `examples/{script}` | {job} | {_cell(says, test, results)} |"
              for script, job, says, test in cells.launched_cells()]
    return "\n".join(lines)


def render(page: str, results: dict[str, str]) -> str:
    """`page` with each table between its markers written from `results`."""
    for name, table in (("kinds", kinds_table(results)), ("launched", launched_table(results))):
        begin, end = BEGIN.format(name), END.format(name)
        if page.count(begin) != 1 or page.count(end) != 1:
            raise SystemExit(f"own_script_table: {PAGE} needs one `{begin}` and one `{end}`")
        page = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: f"{begin}\n{table}\n{end}", page,
                      flags=re.S)
    return page


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--junit", required=True, help="pytest's --junitxml file of a whole run")
    parser.add_argument("--check", action="store_true", help="exit 1 if the page differs from these results")
    args = parser.parse_args()
    with open(PAGE, encoding="utf-8") as f:
        page = f.read()
    written = render(page, test_results(args.junit))
    if args.check:
        if written != page:
            diff = difflib.unified_diff(page.splitlines(), written.splitlines(), "docs/own-script.md",
                                        "from this run's results", lineterm="", n=0)
            sys.exit("\n".join(["own_script_table: the page's tables are not this run's results "
                                "(python tools/own_script_table.py --junit FILE rewrites them):", *diff]))
        return
    with open(PAGE, "w", encoding="utf-8") as f:
        f.write(written)


if __name__ == "__main__":
    main()
