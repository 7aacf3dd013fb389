"""`tfdist bench parameter_server`: both jobs run and the ratio is theirs."""

import pytest

from helpers import run_tfdist
from benchmarks.parameter_server import measure

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(600)]


def test_measure_compares_the_two_jobs():
    result = measure(repeats=1, epochs=2, steps_per_epoch=16, per_device_batch=32, width=8)
    rate = result["samples_per_sec"]
    assert set(rate) == {"parameter_server", "allreduce"}
    assert all(value > 0 for value in rate.values())
    assert result["figures"]["ps_vs_allreduce"] == pytest.approx(rate["parameter_server"] / rate["allreduce"])
    assert "strategy.kind=parameter_server" in result["jobs"]["parameter_server"]
    assert "train.global_batch_size=64" in result["jobs"]["allreduce"]  # 2 x the per-device batch


def test_cli_refuses_a_config():
    proc = run_tfdist("bench", "parameter_server", "--set", "train.epochs=2")
    assert proc.returncode == 2
    assert "`config` is not used by the parameter_server benchmark" in proc.stderr
