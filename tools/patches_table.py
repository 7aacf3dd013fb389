"""Writes the table of tfdist's patches to Keras into docs/architecture.md, from the registry itself.

Each row is one `Patch` of `tfdist._compat.patches.patches()`: its target, whom it serves, why, and the upstream
issue. So the page cannot drift from the code: `make docs` rewrites it, and tests/_compat/test_patch_registry.py
fails when the committed page is stale.

    python tools/patches_table.py            # rewrite the table in docs/architecture.md
    python tools/patches_table.py --check    # exit 1 if it is stale
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "architecture.md")
BEGIN = "<!-- The table below is written by tools/patches_table.py from the registry: do not edit it here. -->"
END = "<!-- End of the table of patches. -->"
sys.path.insert(0, ROOT)


def table() -> str:
    """The Markdown table of every patch, in the order they are installed."""
    from tfdist._compat.patches import patches

    rows = ["| Keras's function (`keras.src.`) | serves calls under | what it changes | upstream |",
            "| --- | --- | --- | --- |"]
    for patch in patches():
        if patch.strategy_of is None:
            serves = "every strategy: nothing changes until tfdist asks"
        elif patch.fixes_tensorflow:
            serves = "tfdist's strategies; TensorFlow's after `fix_tensorflow_strategies()`"
        else:
            serves = "tfdist's strategies"
        if patch.attached:
            serves += " (attached to each optimizer that needs it, not to its class)"
        rows.append(f"| `{patch.target.removeprefix('keras.src.')}` | {serves} | {patch.why} | {patch.upstream} |")
    return "\n".join(rows)


def page_with_table(page: str) -> str:
    before, found, rest = page.partition(BEGIN)
    _, ended, after = rest.partition(END)
    if not (found and ended):
        raise SystemExit(f"{PAGE} has no table markers ({BEGIN} ... {END})")
    return f"{before}{BEGIN}\n{table()}\n{END}{after}"


def main() -> None:
    with open(PAGE) as f:
        page = f.read()
    written = page_with_table(page)
    if "--check" in sys.argv[1:]:
        if written != page:
            raise SystemExit(f"{PAGE} is stale: run python tools/patches_table.py")
        return
    with open(PAGE, "w") as f:
        f.write(written)


if __name__ == "__main__":
    main()
