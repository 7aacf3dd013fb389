"""The few lines `make test` ends with: how long it took, where the time went, how many processes it started.

    python tools/test_summary.py --pytest_seconds 1500 --bazel_seconds 1100 --junit .test-results/pytest.xml \
        --accounting .test-results/pacct

The process counts come from the kernel's process accounting (`accton`, Debian's acct), which `make test`
switches on for its run where it can (as root): one record per process that ended, with its CPU time and
whether it ran a program of its own or was forked and stayed a copy (the test zygote's children).
A TensorFlow process spends 4-6 CPU-seconds importing it, so processes of 2 CPU-seconds or more are
counted: pytest's and Bazel's test processes, the jobs' tasks and ranks, and the zygote's children.
"""

import argparse
import collections
import json
import os
import shutil
import subprocess
import xml.etree.ElementTree as ElementTree

from tfdist.bench.machine import describe

HEAVY_CPU_SECONDS = 2.0


def _clock(seconds: float) -> str:
    return f"{int(seconds) // 60}:{int(seconds) % 60:02d}"


def slowest_tests(junit: str, count: int = 10) -> list[tuple[float, str]]:
    """(seconds, test id) of the `count` longest tests in a pytest JUnit XML file."""
    cases = ElementTree.parse(junit).getroot().iter("testcase")
    timed = [(float(c.get("time", 0)), f"{c.get('classname', '').replace('.', '/')}.py::{c.get('name')}")
             for c in cases]
    return sorted(timed, reverse=True)[:count]


def heavy_processes(accounting: str) -> dict:
    """Counts and CPU-seconds of the processes of 2 CPU-seconds or more in a process-accounting file,
    split into those that started a program and those forked from another that stayed its copy."""
    dump = subprocess.run(["dump-acct", accounting], capture_output=True, text=True, check=True).stdout
    counts = {"started": [0, 0.0], "forked": [0, 0.0], "all": [0, 0.0]}
    hertz = os.sysconf("SC_CLK_TCK")
    for line in dump.splitlines():
        fields = [f.strip() for f in line.split("|")]
        if len(fields) < 12:
            continue
        cpu = (float(fields[2]) + float(fields[3])) / hertz
        counts["all"][0] += 1
        counts["all"][1] += cpu
        if cpu >= HEAVY_CPU_SECONDS:
            kind = "forked" if "F" in fields[11] else "started"
            counts[kind][0] += 1
            counts[kind][1] += cpu
    return counts


def refusals(path: str) -> collections.Counter:
    """(why, the program's first arguments) -> how many processes the test zygote did not fork for it."""
    if not os.path.exists(path):  # none refused
        return collections.Counter()
    with open(path, encoding="utf-8") as log:
        return collections.Counter((r["refusal"], tuple(r["argv"])) for r in map(json.loads, log))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pytest_seconds", type=float, required=True)
    parser.add_argument("--bazel_seconds", type=float, required=True)
    parser.add_argument("--total_seconds", type=float, required=True)
    parser.add_argument("--junit", required=True)
    parser.add_argument("--accounting")
    parser.add_argument("--refusals", help="the test zygote's refusals (tests/zygote.py, REFUSALS_VARIABLE)")
    args = parser.parse_args()
    print(f"=== make test: {_clock(args.total_seconds)} in all; pytest {_clock(args.pytest_seconds)}, "
          f"Bazel's unit tests {_clock(args.bazel_seconds)} beside it ===")
    machine = describe()  # the suite's time differs 2x between the machine kinds CI runs on
    flags = ", ".join(machine["cpu_flags"]) or "no AVX2, AVX-512 or AMX"
    print(f"Machine: {machine['cpu_model']}, {machine['cpu_count']} cores ({flags})")
    if os.path.exists(args.junit):
        print("The 10 slowest tests under pytest:")
        for seconds, test in slowest_tests(args.junit):
            print(f"  {seconds:7.1f} s  {test}")
    if args.accounting and os.path.getsize(args.accounting) and shutil.which("dump-acct"):
        counts = heavy_processes(args.accounting)
        (started, started_cpu), (forked, forked_cpu) = counts["started"], counts["forked"]
        print(f"Processes of {HEAVY_CPU_SECONDS:g} CPU-seconds or more: {started} started ({started_cpu:.0f} CPU-s), "
              f"{forked} forked from one (the test zygote's children: {forked_cpu:.0f} CPU-s); "
              f"all {counts['all'][0]} processes: {counts['all'][1]:.0f} CPU-s")
    else:
        print("Processes: not counted (process accounting needs root and Debian's acct)")
    if args.refusals:
        refused = refusals(args.refusals)
        print(f"Python processes the test zygote could not fork (real interpreters): {sum(refused.values())}")
        for (why, program), count in refused.most_common(8):
            print(f"  {count:4d}  {' '.join(program)}: {why[:160]}")


if __name__ == "__main__":
    main()
