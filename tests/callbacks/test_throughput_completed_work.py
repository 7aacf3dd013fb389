"""Under every strategy kind, samples/sec x the measured wall time is the samples that finished in it.

Each job trains 3 epochs of 16 steps with warm-up 3, and `throughput_probe`
reads the optimizer's applied-step counter where each measured window opens and
closes. Counting a step when its call returns instead of when it has run (a
parameter-server job queues up to 4 steps ahead) is off by 4/16 = 25% an epoch.
"""

import json
import os
import subprocess
import sys

import pytest

import throughput_probe
from helpers import ROOT, free_ports, horovodrun, patient, why_it_failed
import zygote

PROBE = throughput_probe.__file__
TOLERANCE = 0.05
COMMON = ["train.epochs=3", "train.steps_per_epoch=16", "train.global_batch_size=32",
          "callbacks.throughput_warmup_steps=3", "model.width=8"]


def _assert_claims_match_completed_work(result):
    assert len(result["windows"]) == 3  # every epoch measured
    for part in [*result["windows"], result["total"]]:
        assert part["completed"] > 0
        assert abs(part["claimed"] - part["completed"]) <= TOLERANCE * part["completed"], result


@pytest.mark.parametrize("overrides", [
    ["strategy.kind=one_device"],
    ["strategy.kind=mirrored", "strategy.logical_devices=2"],
    ["strategy.kind=pipeline", "strategy.logical_devices=2", "pipeline.num_stages=2", "pipeline.num_micro_batches=4"],
    ["strategy.kind=tensor_parallel", "strategy.logical_devices=2", "model.name=transformer", "model.width=16",
     "model.heads=2", "model.depth=1"],
], ids=["one_device", "mirrored", "pipeline", "tensor_parallel"])
def test_single_process_kinds(overrides):
    _assert_claims_match_completed_work(throughput_probe.measure([*COMMON, *overrides]))


def _probe_processes(tmp_path, commands, timeout=240):
    procs = [zygote.Popen(c, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}) for c in commands]
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=patient(timeout))
            assert proc.returncode == 0, err[-3000:]
    finally:
        for proc in procs:
            proc.kill()
    return json.loads((tmp_path / "probe.json").read_text())


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_parameter_server_counts_steps_that_ran_on_workers_not_steps_queued(tmp_path):
    out = str(tmp_path / "probe.json")
    overrides = ["strategy.kind=parameter_server", "parameter_server.num_workers=2", "parameter_server.num_ps=1",
                 "parameter_server.threads_per_task=1"]
    result = _probe_processes(tmp_path, [[sys.executable, PROBE, out, *COMMON, *overrides]])
    _assert_claims_match_completed_work(result)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_multi_worker_mirrored(tmp_path):
    out = str(tmp_path / "probe.json")
    workers = ", ".join(f"127.0.0.1:{p}" for p in free_ports(2))
    overrides = ["strategy.kind=multi_worker_mirrored", f"cluster.workers=[{workers}]"]
    result = _probe_processes(tmp_path, [[sys.executable, PROBE, out, *COMMON, *overrides, f"cluster.task_index={i}"]
                                         for i in range(2)])
    _assert_claims_match_completed_work(result)


@pytest.mark.multiprocess
@pytest.mark.horovod
@pytest.mark.timeout(300)
def test_horovod(tmp_path):
    out = tmp_path / "probe.json"
    done = horovodrun([sys.executable, PROBE, str(out), *COMMON, "strategy.kind=horovod"])
    assert done.returncode == 0, why_it_failed(done.stderr)
    _assert_claims_match_completed_work(json.loads(out.read_text()))
