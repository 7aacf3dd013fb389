"""Shared fixtures. TensorFlow-free tests never import TensorFlow."""

import json
import os
import resource
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The suite's devices are logical CPUs: device counts, placements and figures
# are stated for them. On a GPU host, TensorFlow here and in every child process
# would otherwise pick the GPUs (and a different number of replicas).
os.environ["CUDA_VISIBLE_DEVICES"] = "-1"
# A process that crashes (a segfault in a native library) prints every thread's Python stack,
# so the test's output says where.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")
# TensorFlow's CPU kernels without oneDNN (Eigen's), in every process of the suite, whatever the CPU: TensorFlow
# turns oneDNN on by itself only on CPUs with AVX-512 or AMX, and the kernels round differently, so the suite
# asserts what holds on every machine kind CI uses (an AVX2 CPU runs these anyway). `TF_ENABLE_ONEDNN_OPTS=1
# make test` runs it with oneDNN; the tests that measure with oneDNN's allocator set it for their processes.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

LOGICAL_CPUS = 4
# The scripts tests run as processes, importable by name (a test may share their code).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "scenarios"))
import zygote  # noqa: E402,F401  (names the test zygote's socket in the environment every process inherits)
from machine_speed import slowness  # noqa: E402


def pytest_configure(config):
    """Measures the machine's slowness once, before pytest-xdist starts its workers (they inherit it)."""
    del config
    slowness()


def pytest_collection_modifyitems(config, items):
    """Each test's time limit, its `timeout` mark's or the configured default, is set for the slowest
    machine kind CI uses: scaled here by this machine's slowness against it (`helpers.patient`)."""
    from helpers import patient

    configured = config.getini("timeout")  # none under Bazel, whose runs read no pyproject.toml
    for item in items:
        marker = item.get_closest_marker("timeout")
        seconds = (marker.args[0] if marker.args else marker.kwargs["timeout"]) if marker else configured
        if seconds:
            item.add_marker(pytest.mark.timeout(patient(float(seconds))), append=False)


def pytest_runtest_setup(item):
    """A `horovod` test is skipped, saying so, where Horovod is not installed;
    `make test` sets TFDIST_REQUIRE_HOROVOD=1, where it fails instead."""
    if item.get_closest_marker("horovod") is None:
        return
    try:
        import horovod.tensorflow  # noqa: F401
    except ImportError as error:
        if os.environ.get("TFDIST_REQUIRE_HOROVOD") == "1":
            pytest.fail(f"Horovod is required here and does not import: {error}")
        pytest.skip(f"needs Horovod, which does not import here ({error}); `make setup` builds it")


CPU_LOG_VARIABLE = "TFDIST_TEST_CPU_LOG"  # a file: each test's CPU-seconds in its pytest process, a JSON line


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Logs the CPU the test spent in this process and the processes it waited for (the test zygote's children
    are the zygote's: their CPU is in the process accounting, by the test its fork log names)."""
    path = os.environ.get(CPU_LOG_VARIABLE)
    before = _cpu_seconds()
    yield
    if path:
        with open(path, "a", encoding="utf-8") as log:
            log.write(json.dumps({"test": item.nodeid, "cpu": round(_cpu_seconds() - before, 2)}) + "\n")


def _cpu_seconds():
    return sum(usage.ru_utime + usage.ru_stime
               for usage in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))


@pytest.fixture(scope="session", autouse=True)
def cpus():
    """Splits the CPU into 4 logical devices before any test can start TensorFlow."""
    from tfdist.strategies.devices import ensure_logical_cpus

    ensure_logical_cpus(LOGICAL_CPUS)
    return LOGICAL_CPUS


@pytest.fixture(autouse=True)
def _float32_policy():
    """Tests that switch the global Keras dtype policy do not leak it."""
    yield
    if "keras" in sys.modules:
        sys.modules["keras"].mixed_precision.set_dtype_policy("float32")
