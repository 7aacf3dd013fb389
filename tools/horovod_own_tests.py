"""Horovod's own TensorFlow tests, run against real Horovod and against tfdist's port: the outside judge of the port.

    git clone --depth 1 --branch v0.28.1 https://github.com/horovod/horovod /tmp/horovod
    python tools/horovod_own_tests.py /tmp/horovod [--json OUT.json] [--file test_tensorflow.py ...]

Horovod's test files are not part of tfdist (and its sdist on PyPI leaves them out), so this tool reads them from a
checkout of Horovod at the version tfdist builds (tools/install_horovod.sh), copies them, and runs each file as
Horovod runs it: `horovodrun -np 2 -H localhost:2 --gloo python -m pytest FILE`, once as they are and once with only
the `import horovod.tensorflow(.keras) as hvd` lines switched to tfdist's port. It prints a table of outcomes per file
and every test that passes against Horovod but not against the port (what the port still owes), and writes both in
JSON. Needs what the tests import beyond tfdist's test tools: `pip install parameterized mock`.
"""

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree

FILES = ("test_tensorflow.py", "test_tensorflow2_keras.py", "test_tensorflow_keras.py",
         "test_tensorflow_process_sets.py", "test_tensorflow2_keras_process_sets.py")
PORT_IMPORTS = {  # the lines a user changes; nothing else in the tests is touched
    r"^(\s*)import horovod\.tensorflow\.keras as hvd$": r"\1import tfdist.horovod.tensorflow.keras as hvd",
    r"^(\s*)import horovod\.tensorflow as hvd$": r"\1import tfdist.horovod.tensorflow as hvd",
}
SECONDS_PER_FILE = 1200


def copy_tests(checkout: str, into: str, port: bool) -> str:
    """Horovod's test/ directory copied into `into`, its import lines switched to the port if `port`."""
    tests = os.path.join(into, "test")
    shutil.copytree(os.path.join(checkout, "test"), tests)
    if port:
        for name in FILES:
            path = os.path.join(tests, "parallel", name)
            with open(path, encoding="utf-8") as file:
                text = file.read()
            for pattern, replacement in PORT_IMPORTS.items():
                text = re.sub(pattern, replacement, text, flags=re.MULTILINE)
            with open(path, "w", encoding="utf-8") as file:
                file.write(text)
    return os.path.join(tests, "parallel")


def run_file(directory: str, name: str) -> dict:
    """Each test of one file and its outcome on rank 0 ("passed", "failed", "error", "skipped")."""
    report = os.path.join(directory, f"{name}.rank0.xml")
    # Each rank writes its own report; rank 0's is read (a collective fails on both ranks or neither).
    command = ["horovodrun", "-np", "2", "-H", "localhost:2", "--gloo", "sh", "-c",
               f'exec {sys.executable} -m pytest -q -p no:cacheprovider {name} '
               f'--junitxml={directory}/{name}.rank$HOROVOD_RANK.xml']
    try:
        subprocess.run(command, cwd=directory, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=SECONDS_PER_FILE, check=False)
    except subprocess.TimeoutExpired:
        return {"(the whole file)": f"error: no end within {SECONDS_PER_FILE} s"}
    if not os.path.exists(report):
        return {"(the whole file)": "error: no report (the job ended before pytest wrote one)"}
    outcomes = {}
    for case in ElementTree.parse(report).iter("testcase"):
        test = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        ends = {child.tag: child for child in case}
        outcome = next((outcome for tag, outcome in (("error", "error"), ("failure", "failed"),
                                                      ("skipped", "skipped")) if tag in ends), "passed")
        ending = ends.get({"failed": "failure", "error": "error"}.get(outcome, ""))
        why = (ending.get("message") or "").splitlines() if ending is not None else []
        outcomes[test] = f"{outcome}: {why[0][:160]}" if why else outcome
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", help="a checkout of Horovod (its test/ directory is read)")
    parser.add_argument("--file", action="append", choices=FILES, help="only these files (default: all five)")
    parser.add_argument("--json", help="write every outcome here")
    args = parser.parse_args()
    if not os.path.isdir(os.path.join(args.checkout, "test", "parallel")):
        sys.exit(f"tools/horovod_own_tests.py: error: {args.checkout} has no test/parallel (a Horovod checkout?)")
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for against in ("horovod", "tfdist"):
            directory = copy_tests(args.checkout, os.path.join(scratch, against), port=against == "tfdist")
            results[against] = {name: run_file(directory, name) for name in args.file or FILES}
            print(f"ran Horovod's tests against {against}", file=sys.stderr)
    print("| file | against | passed | failed | error | skipped |\n| --- | --- | --- | --- | --- | --- |")
    for name in args.file or FILES:
        for against in ("horovod", "tfdist"):
            counts = collections.Counter(outcome.split(":")[0] for outcome in results[against][name].values())
            print(f"| {name} | {against} | {counts['passed']} | {counts['failed']} | {counts['error']} | "
                  f"{counts['skipped']} |")
    owed = sorted(f"{name}::{test}" for name in args.file or FILES
                  for test, outcome in results["horovod"][name].items()
                  if outcome == "passed" and results["tfdist"][name].get(test) != "passed")
    print(f"\npassing against Horovod, not against the port: {len(owed)}")
    print("\n".join(f"  {test} ({results['tfdist'][test.split('::')[0]].get(test.split('::', 1)[1])})"
                    for test in owed))
    failing = sorted(f"{name}::{test} ({outcome})" for name in args.file or FILES
                     for test, outcome in results["tfdist"][name].items() if outcome.startswith(("failed", "error")))
    print(f"\nfailing against the port (each with why; compare with Horovod's above): {len(failing)}")
    print("\n".join(f"  {test}" for test in failing))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"results": results, "owed": owed}, out, indent=1)


if __name__ == "__main__":
    main()
