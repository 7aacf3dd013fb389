"""`tfdist bench scaling`: device counts, the table, the plot, and one real run from the CLI."""

import json

import matplotlib.image
import pytest

from helpers import run_tfdist, why_it_failed
from tfdist.bench.scaling import device_counts, markdown_table, plot

RESULT = {
    "model": "digits_cnn",
    "batch_per_device": 64,
    "table": {
        "mirrored": [{"devices": 1, "samples_per_sec": 1000.0, "speedup": 1.0, "efficiency": 1.0},
                     {"devices": 2, "samples_per_sec": 1700.0, "speedup": 1.7, "efficiency": 0.85},
                     {"devices": 4, "samples_per_sec": 3000.0, "speedup": 3.0, "efficiency": 0.75}],
        "horovod": [{"devices": 1, "samples_per_sec": 900.0, "speedup": 1.0, "efficiency": 1.0},
                    {"devices": 2, "samples_per_sec": 1620.0, "speedup": 1.8, "efficiency": 0.9}],
    },
}


def test_device_counts_double_up_to_the_limit():
    assert device_counts(1) == [1]
    assert device_counts(4) == [1, 2, 4]
    assert device_counts(6) == [1, 2, 4, 6]


def test_the_plot_has_axes_labels_every_backend_and_the_ideal_line(tmp_path):
    path = tmp_path / "scaling.png"
    figure = plot(RESULT, str(path))
    axes = figure.axes[0]
    assert axes.get_xlabel() == "devices" and "speed-up" in axes.get_ylabel()
    lines = {line.get_label(): line for line in axes.get_lines()}
    assert set(lines) == {"ideal (speed-up = devices)", "mirrored", "horovod"}
    assert list(lines["ideal (speed-up = devices)"].get_ydata()) == [1, 4]
    assert list(lines["mirrored"].get_ydata()) == [1.0, 1.7, 3.0]
    image = matplotlib.image.imread(path)  # a real PNG
    assert image.shape[0] > 200 and image.shape[1] > 200
    assert image[..., :3].std() > 0.05  # not blank


def test_the_markdown_table_has_a_row_per_backend_and_count():
    rows = markdown_table(RESULT).splitlines()
    assert rows[0] == "| backend | devices | samples/sec | speed-up | efficiency |"
    assert "| mirrored | 4 | 3000 | 3.00 | 0.75 |" in rows and "| horovod | 2 | 1620 | 1.80 | 0.90 |" in rows
    assert len(rows) == 2 + 5


@pytest.mark.slow
def test_cli_writes_the_table_and_the_plot(tmp_path):
    out, png = tmp_path / "scaling.json", tmp_path / "scaling.png"
    proc = run_tfdist("bench", "scaling", "--config", "configs/default.yaml", "--set", "strategy.logical_devices=2",
                      "--set", "train.global_batch_size=32", "--repeats", "1", "--json", str(out), "--plot", str(png),
                      timeout=600)
    assert proc.returncode == 0, why_it_failed(proc.stderr)
    result = json.loads(out.read_text())
    for backend in ("mirrored", "horovod"):  # make setup installs Horovod
        rows = result["table"][backend]
        assert [r["devices"] for r in rows] == [1, 2]
        assert rows[0]["speedup"] == 1.0 and all(r["samples_per_sec"] > 0 for r in rows)
        assert rows[1]["efficiency"] == pytest.approx(rows[1]["speedup"] / 2)
    assert result["batch_per_device"] == 32 and result["plot"] == str(png)
    assert matplotlib.image.imread(png).shape[2] in (3, 4)
    assert "scaling: horovod_efficiency_at_2=" in proc.stdout


def test_cli_needs_a_config_and_refuses_a_plot_elsewhere():
    proc = run_tfdist("bench", "scaling")
    assert proc.returncode == 2 and "`config` is needed by the scaling benchmark" in proc.stderr
    proc = run_tfdist("bench", "overhead", "--plot", "x.png")
    assert proc.returncode == 2 and "`plot` only applies to `bench network` or `bench scaling` or `bench synthetic`; overhead draws no plot" in proc.stderr


def test_a_plot_without_matplotlib_is_one_line_saying_how_to_get_it(monkeypatch):
    import importlib.util

    import tfdist.bench
    from tfdist import load_config
    from tfdist.errors import ConfigError

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: None if name == "matplotlib" else find_spec(name, *rest))
    with pytest.raises(ConfigError, match=r"`plot` needs matplotlib, which is not installed: pip install 'tfdist\[plots\]'"):
        tfdist.bench.run("scaling", config=load_config("configs/default.yaml"), plot_path="x.png")
