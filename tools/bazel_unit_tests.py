"""Prints the test files `bazel test //...` runs (tests/BUILD targets not tagged `manual`).

`make test` runs those under Bazel and everything else under pytest, so no
test runs twice.
"""

import os
import re

BUILD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "BUILD")

with open(BUILD) as f:
    for target in re.findall(r"pytest_test\((.*?)\)\n", f.read(), re.S):
        if '"manual"' not in target:
            sources = re.search(r"srcs = \[(.*?)\]", target, re.S)[1]
            for source in re.findall(r'"([^"]+)"', sources):
                print("tests/" + source)
