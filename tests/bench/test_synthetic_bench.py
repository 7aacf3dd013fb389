"""`tfdist bench synthetic`: one model under every strategy kind, as a table and a plot."""

import json

import pytest

from helpers import run_tfdist, why_it_failed
from tfdist.bench.jobs import on_core
from tfdist.bench.synthetic import jobs, markdown_table

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]


@pytest.mark.horovod
def test_every_kind_trains_the_model_and_the_table_relates_each_to_one_device(tmp_path):
    out, plot = tmp_path / "synthetic.json", tmp_path / "synthetic.png"
    # A small built-in model keeps this quick; keras.applications models build the same way (tests/data).
    proc = run_tfdist("bench", "synthetic", "--model", "mlp", "--image_size", "8", "--batch_per_device", "8",
                      "--repeats", "1", "--json", str(out), "--plot", str(plot), timeout=540)
    assert proc.returncode == 0, why_it_failed(proc.stderr)
    result = json.loads(out.read_text())
    rows = {row["job"]: row for row in result["table"]}
    assert list(rows) == ["one_device", "mirrored_2", "mirrored_4", "horovod_2", "multi_worker_2", "parameter_server"]
    base = rows["one_device"]["images_per_sec"]
    for row in rows.values():
        assert row["images_per_sec"] > 0
        assert row["images_per_sec_per_device"] == pytest.approx(row["images_per_sec"] / row["devices"])
        assert row["speedup"] == pytest.approx(row["images_per_sec"] / base)
        assert row["efficiency"] == pytest.approx(row["speedup"] / row["devices"])
    assert result["machine"]["cpu_model"] and plot.stat().st_size > 0
    assert markdown_table(result).count("\n") == 1 + len(rows)


def test_each_job_keeps_the_batch_per_device():
    planned = jobs(model="keras.applications.ResNet50", image_size=224, batch_per_device=64, steps=20,
                   synthetic_examples=1024)
    for name, job in planned.items():
        sets = dict(o.split("=", 1) for o in job["overrides"])
        per_step_devices = 1 if name == "parameter_server" else job["devices"]  # a ps step is one worker's batch
        assert int(sets["train.global_batch_size"]) == 64 * per_step_devices
        assert sets["model.name"] == "keras.applications.ResNet50" and sets["data.image_size"] == "224"
    assert planned["multi_worker_2"]["command"] == ("launch", "--workers", "2")
    assert tuple(planned["one_device"]["launcher"]) == on_core(0)  # one device, one core


@pytest.mark.parametrize("args, message", [
    (["bench", "synthetic"], "`model` is needed by the synthetic benchmark"),
    (["bench", "synthetic", "--model", "resnet"], "`model` must be a built-in model"),
    (["bench", "overhead", "--model", "mlp"], "`model` only applies to `bench synthetic` or `bench network`."),
])
def test_bad_flags_are_one_line(args, message):
    proc = run_tfdist(*args)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(f"tfdist: error: {message}")
