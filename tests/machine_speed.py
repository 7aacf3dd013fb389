"""How slow this machine is against the slowest kind CI runs on: the factor every test's time limit is scaled by.

The suite's time limits are set for the 2-core AMD EPYC with AVX2 alone (TensorFlow without oneDNN), the
slowest machine CI uses: a fresh clone's `make test` takes about 1.4 times as long there as on the AVX-512
EPYC. On a slower or busier machine a limit that held there would fail a test that is only slow, so
`slowness()` times a fixed piece of work here and divides it by that machine's time for it: 1.0 there
(and on any faster machine: a limit is never cut below what the reference machine needs), 2.0 on a machine
twice as slow. The work is what a test's process spends its CPU on: Python building objects and calling
functions (TensorFlow's tracing) and float32 arithmetic over arrays (its kernels; elementwise, so that no
BLAS thread pool waits on a busy core); the fastest of several repeats, so a moment's load does not count.

`make test` measures it once and exports `TFDIST_TEST_SLOWNESS`, which every process it starts (pytest's
workers, Bazel's tests, the jobs they start) inherits; without it the first caller measures (about a
second) and sets it for its children.

    python tests/machine_speed.py      # prints the factor
"""

import os
import time

import numpy as np

VARIABLE = "TFDIST_TEST_SLOWNESS"
# The work's fastest time of 7 on the reference machine (the 2-core AMD EPYC with AVX2 alone, quiet), in seconds:
# 0.18-0.28 in repeated runs there (a virtual machine's neighbours move it), so a factor up to 1.5 is noise.
REFERENCE_SECONDS = 0.19
REPEATS = 7


def _work() -> float:
    """Seconds for one round of the work: Python objects and calls, then float32 arithmetic over arrays."""
    start = time.perf_counter()
    nodes = {}
    for i in range(60_000):
        nodes[f"op_{i}"] = {"inputs": [i - 1, i - 2], "name": str(i), "shape": (i % 7, i % 5)}
    sum(len(node["inputs"]) + len(node["shape"]) for node in nodes.values())
    values = np.linspace(-1.0, 1.0, 1_000_000, dtype=np.float32)
    for _ in range(20):
        values = np.tanh(values * 1.5 + 0.1)
    return time.perf_counter() - start


def measure() -> float:
    """This machine's slowness against the reference machine, at least 1.0."""
    fastest = min(_work() for _ in range(REPEATS))
    return max(1.0, round(fastest / REFERENCE_SECONDS, 2))


def slowness() -> float:
    """The factor from the environment, measured and put there on first use."""
    if not os.environ.get(VARIABLE):
        os.environ[VARIABLE] = str(measure())
    return float(os.environ[VARIABLE])


if __name__ == "__main__":
    print(measure())
