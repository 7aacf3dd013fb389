"""Shared fixtures. TensorFlow-free tests never import TensorFlow."""

import os
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

LOGICAL_CPUS = 4


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
