"""`tfdist.training.run` in-process: results, summary, JSON and TensorBoard logs."""

import contextlib
import io
import json

from tfdist import load_config
from tfdist.training import run


def test_run_returns_and_writes_the_results(tmp_path):
    config = load_config(
        None,
        [
            "train.epochs=2",
            "train.steps_per_epoch=8",
            "train.verbose=0",
            "callbacks.throughput_warmup_steps=2",
            f"callbacks.tensorboard_dir={tmp_path / 'tb'}",
            "strategy.devices=[/cpu:0, /cpu:1]",
        ],
    )
    out = io.StringIO()
    metrics = tmp_path / "m.json"
    with contextlib.redirect_stdout(out):  # the summary goes to sys.stdout as it is when printed
        result = run(config, metrics_out=str(metrics))

    assert json.loads(metrics.read_text()) == json.loads(json.dumps(result))
    assert result["strategy"] == "mirrored"
    assert result["num_replicas"] == 2
    assert result["steps_per_epoch"] == 8
    assert result["samples_per_sec"] > 0 and result["step_time_ms"] > 0
    assert {"loss", "accuracy", "val_loss", "val_accuracy"} <= set(result["final"])
    summary = out.getvalue()
    assert "strategy        mirrored (2 replica(s))" in summary
    assert "local devices   CPU:0, CPU:1" in summary
    assert f"val_accuracy    {result['final']['val_accuracy']:.4f}" in summary
    events = list((tmp_path / "tb").rglob("events.out.tfevents.*"))
    assert {p.parent.name for p in events} == {"train", "validation"}
