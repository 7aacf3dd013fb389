"""Every exact equality the tests assert says why it holds.

Two runs give the same floats only where the same kernels see the same shapes in the same order (a copy of
saved bytes, the same steps from the same state in one process, integers). Across devices, batch shares,
machines and kernel libraries (oneDNN or Eigen on CPUs, cuDNN's shape-chosen algorithms on GPUs) sums round
in another order, and a test asserting 0.0 there passes on one machine and fails on the next. So an exact
assert carries a comment with `exact` and its reason, on its line or one of the two above; anything else is
a tolerance, with its bound written beside it.
"""

import os
import re

from helpers import ROOT

EXACT = re.compile(r"assert_array_equal\(|np\.array_equal\(|\batol=0\b(?!\.\d*[1-9])|[<=]= 0\.0\b|"
                   r"tolerance\w* = (.* else )?0\.0\b|\babs=0\b(?!\.)")
REASON = re.compile(r"#.*\bexact\b|\"\"\".*`?exact`?:", re.I)


def _test_sources():
    for directory, _, files in os.walk(os.path.join(ROOT, "tests")):
        for name in sorted(files):
            if name.endswith(".py") and name != os.path.basename(__file__):
                yield os.path.join(directory, name)


def unexplained_exact_asserts(lines):
    """The (number, line) of each exact-equality line without a reason on it or the two lines above."""
    return [(number, line.strip()) for number, line in enumerate(lines, 1)
            if EXACT.search(line.split("#")[0]) and not any(REASON.search(above)
                                                            for above in lines[max(0, number - 3):number])]


def test_the_checker_finds_a_bare_exact_assert_and_accepts_a_reason():
    bare = ["np.testing.assert_allclose(a, b, atol=0, rtol=0)", "assert difference <= 0.0",
            "tolerance = 0.0", "np.testing.assert_array_equal(a, b)", "tolerance = 1e-5 if split else 0.0"]
    assert [number for number, _ in unexplained_exact_asserts(bare)] == [1, 2, 3, 4, 5]
    explained = ["# exact: a copy of the saved bytes", "np.testing.assert_array_equal(a, b)",
                 "assert difference <= 0.0  # exact: nothing ran"]
    assert unexplained_exact_asserts(explained) == []
    assert unexplained_exact_asserts(["np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)"]) == []


def test_every_exact_assert_in_the_tests_says_why_it_holds():
    found = []
    for path in _test_sources():
        with open(path, encoding="utf-8") as f:
            found += [f"{os.path.relpath(path, ROOT)}:{n}: {line}" for n, line in unexplained_exact_asserts(f.readlines())]
    assert not found, "exact equality without `# exact: <why>` (or a tolerance with its bound):\n" + "\n".join(found)
