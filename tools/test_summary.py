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


def accounted_processes(accounting: str) -> list[tuple[int, float, bool]]:
    """(PID, CPU-seconds, forked and stayed its parent's copy) of each process in a process-accounting file."""
    dump = subprocess.run(["dump-acct", accounting], capture_output=True, text=True, check=True).stdout
    hertz = os.sysconf("SC_CLK_TCK")
    processes = []
    for line in dump.splitlines():
        fields = [f.strip() for f in line.split("|")]
        if len(fields) >= 12:
            processes.append((int(fields[9]), (float(fields[2]) + float(fields[3])) / hertz, "F" in fields[11]))
    return processes


def heavy_processes(processes: list) -> dict:
    """Counts and CPU-seconds of the processes of 2 CPU-seconds or more, split into those that started a
    program and those forked from another that stayed its copy."""
    counts = {"started": [0, 0.0], "forked": [0, 0.0], "all": [0, 0.0]}
    for _, cpu, forked in processes:
        counts["all"][0] += 1
        counts["all"][1] += cpu
        if cpu >= HEAVY_CPU_SECONDS:
            kind = "forked" if forked else "started"
            counts[kind][0] += 1
            counts[kind][1] += cpu
    return counts


def _json_lines(path: str) -> list[dict]:
    if not path or not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as log:
        return [json.loads(line) for line in log]


def cpu_by_test(cpu_log: str, forks_log: str, processes: list) -> dict[str, list[float]]:
    """test id -> [CPU-seconds in its pytest process and the processes it waited for, CPU-seconds of the
    test zygote's children it asked for] (a child's test is the one its environment named)."""
    by_test = collections.defaultdict(lambda: [0.0, 0.0])
    for record in _json_lines(cpu_log):
        by_test[record["test"]][0] += record["cpu"]
    cpu_of = {pid: cpu for pid, cpu, _ in processes}
    for record in _json_lines(forks_log):
        test = (record["test"] or "(no test)").rsplit(" (", 1)[0]  # without the phase: "(setup)", "(call)"
        by_test[test][1] += cpu_of.get(record["pid"], 0.0)
    return by_test


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
    parser.add_argument("--forks", help="the test zygote's children (tests/zygote.py, FORKS_VARIABLE)")
    parser.add_argument("--cpu_log", help="each test's CPU in its pytest process (tests/conftest.py, CPU_LOG_VARIABLE)")
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
        processes = accounted_processes(args.accounting)
        counts = heavy_processes(processes)
        (started, started_cpu), (forked, forked_cpu) = counts["started"], counts["forked"]
        print(f"Processes of {HEAVY_CPU_SECONDS:g} CPU-seconds or more: {started} started ({started_cpu:.0f} CPU-s), "
              f"{forked} forked from one (the test zygote's children: {forked_cpu:.0f} CPU-s); "
              f"all {counts['all'][0]} processes: {counts['all'][1]:.0f} CPU-s")
        by_test = cpu_by_test(args.cpu_log, args.forks, processes)
        if by_test:
            print(f"CPU-seconds of pytest's tests: {sum(map(sum, by_test.values())):.0f}; the 10 largest "
                  "(in pytest's process and what it waited for + the zygote's children):")
            for test, (own, forked) in sorted(by_test.items(), key=lambda item: -sum(item[1]))[:10]:
                print(f"  {own + forked:7.1f} = {own:6.1f} + {forked:6.1f}  {test}")
    else:
        print("Processes: not counted (process accounting needs root and Debian's acct)")
    if args.refusals:
        refused = refusals(args.refusals)
        print(f"Python processes the test zygote could not fork (real interpreters): {sum(refused.values())}")
        for (why, program), count in refused.most_common(8):
            print(f"  {count:4d}  {' '.join(program)}: {why[:160]}")


if __name__ == "__main__":
    main()
