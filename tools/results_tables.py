"""What the tools that write a docs page's tables from a test run share: the run's JUnit results, the tables put
between their markers, and the page rewritten or checked (`make test` checks each page against its own run).

A cell of such a table says what its test shows only if that test passed, else "failed", "skipped" or "not run".
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
import xml.etree.ElementTree as ElementTree
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the tables' cells are test data


def test_results(junit: str) -> dict[str, str]:
    """Test id ("tests/a/test_b.py::name[params]") -> "passed", "failed" or "skipped", from a JUnit XML file."""
    results = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        tags = {child.tag for child in case}
        status = "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
        name = re.sub(r"@\w+$", "", case.get("name"))  # pytest-xdist's group of a test that has one
        results[f"{case.get('classname').replace('.', '/')}.py::{name}"] = status
    return results


def cell(says: str, test: str, results: dict[str, str]) -> str:
    """What a cell says when `test` passed, else its status in bold."""
    status = results.get(test, "not run")
    return says if status == "passed" else f"**{status}**"


def render(page: str, tables: dict[str, str], tool: str) -> str:
    """`page` with each table (name -> Markdown) between its markers, which `tool` writes."""
    for name, table in tables.items():
        begin, end = f"<!-- {name}: written by {tool} from the test results -->", f"<!-- end of {name} -->"
        if page.count(begin) != 1 or page.count(end) != 1:
            raise SystemExit(f"{tool}: the page needs one `{begin}` and one `{end}`")
        page = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: f"{begin}\n{table}\n{end}", page,
                      flags=re.S)
    return page


def main(description: str, page_path: str, tables: Callable[[dict[str, str]], dict[str, str]], tool: str) -> None:
    """The command line of a table tool: `--junit FILE` rewrites the page's tables, `--check` exits 1 if differ."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--junit", required=True, help="pytest's --junitxml file of a whole run")
    parser.add_argument("--check", action="store_true", help="exit 1 if the page differs from these results")
    args = parser.parse_args()
    with open(page_path, encoding="utf-8") as f:
        page = f.read()
    written = render(page, tables(test_results(args.junit)), tool)
    if args.check:
        if written != page:
            shown = os.path.relpath(page_path, ROOT)
            diff = difflib.unified_diff(page.splitlines(), written.splitlines(), shown, "from this run's results",
                                        lineterm="", n=0)
            sys.exit("\n".join([f"{tool}: the tables of {shown} are not this run's results "
                                f"(python {tool} --junit FILE rewrites them):", *diff]))
        return
    with open(page_path, "w", encoding="utf-8") as f:
        f.write(written)
