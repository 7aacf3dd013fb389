"""Alternated timing: warm-up untimed, rounds alternate, medians."""

import pytest

from helpers import patient

from tfdist.timing import alternate, medians


def test_rounds_alternate_after_untimed_warmup():
    calls = []

    def variant(name, value):
        def run():
            calls.append(name)
            return value

        return run

    samples = alternate({"a": variant("a", 1.0), "b": variant("b", 2.0)}, repeats=4, warmup=1)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b", "b", "a"]
    assert samples == {"a": [1.0] * 4, "b": [2.0] * 4}


def test_rounds_say_how_far_they_are_a_line_a_round_in_a_log(capsys):
    alternate({"a": lambda: 1.0, "b": lambda: 2.0, "c": lambda: 3.0}, repeats=2, warmup=1)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(", ")[:2] for line in lines] == [
        ["tfdist bench: warm-up", "3 of 9 runs"], ["tfdist bench: round 1 of 2", "6 of 9 runs"],
        ["tfdist bench: round 2 of 2", "9 of 9 runs"]]
    assert all(" so far, about " in line and " left (" in line for line in lines)
    assert lines[-1].endswith("about 0:00 left (a)")  # the second round runs them in reverse
    alternate({"a": lambda: 1.0}, repeats=1, progress=False)
    assert capsys.readouterr().err == ""


def test_medians():
    assert medians({"a": [3.0, 1.0, 2.0], "b": [4.0]}) == {"a": 2.0, "b": 4.0}


def test_repeats_must_be_positive():
    with pytest.raises(ValueError, match="`repeats` must be >= 1"):
        alternate({"a": lambda: 1.0}, repeats=0)


def test_machine_reads_the_cpu_model_count_and_flags(tmp_path):
    from tfdist.bench import machine

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu avx2 fma avx512f amx_bf16\n")
    described = machine.describe(str(cpuinfo))
    assert described["cpu_model"] == "Test CPU 9000"
    assert described["cpu_flags"] == ["avx2", "fma", "avx512f", "amx_bf16"]
    assert described["cpu_count"] >= 1
    versions = described["versions"]
    assert versions["tensorflow"].startswith("2.") and versions["keras"].startswith("3.")
    assert set(versions) == {"tensorflow", "keras", "horovod"}


def test_on_core_runs_its_command_pinned_to_that_core():
    import subprocess
    import sys

    from tfdist.bench.jobs import on_core

    done = subprocess.run([*on_core(0), sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                          capture_output=True, text=True, timeout=patient(60))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[0]"
