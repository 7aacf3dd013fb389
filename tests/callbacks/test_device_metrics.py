"""DeviceMetrics: NVML against a fake module, the CPU path for real, TensorBoard read back."""

import glob
import types
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from helpers import train_with_metrics
from tfdist.callbacks import DeviceMetrics

GIB = 1024**3


class FakeNvml:
    """The parts of pynvml DeviceMetrics uses: two GPUs, the second without a power sensor."""

    NVML_TEMPERATURE_GPU = 0

    class NVMLError(Exception):
        pass

    def __init__(self, init_error=None):
        self.init_error = init_error
        self.shut_down = False
        self.power_reads = 0

    def nvmlInit(self):
        if self.init_error:
            raise self.NVMLError(self.init_error)

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetUtilizationRates(self, handle):
        return types.SimpleNamespace(gpu=40 + handle, memory=5)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return types.SimpleNamespace(used=(1 + handle) * GIB, total=16 * GIB, free=(15 - handle) * GIB)

    def nvmlDeviceGetPowerUsage(self, handle):
        self.power_reads += 1
        if handle == 1:
            raise self.NVMLError("Not Supported")
        return 150_000  # milliwatts

    def nvmlDeviceGetTemperature(self, handle, sensor):
        assert sensor == self.NVML_TEMPERATURE_GPU
        return 60 + handle

    def nvmlShutdown(self):
        self.shut_down = True


def _fit(callback, epochs=2, verbose=0):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((64, 4), "float32"), np.zeros((64, 2), "float32")
    return model.fit(x, y, batch_size=8, epochs=epochs, callbacks=[callback], verbose=verbose).history


def _scalars(log_dir):
    """tag -> values of every scalar in the event files under `log_dir`."""
    found = {}
    for path in glob.glob(f"{log_dir}/**/events.out.tfevents.*", recursive=True):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == "scalars":
                    found.setdefault(value.tag, []).append(float(tf.make_ndarray(value.tensor)))
    return found


def test_nvml_readings_reach_the_logs_and_tensorboard(tmp_path):
    nvml = FakeNvml()
    callback = DeviceMetrics(interval_seconds=3600, log_dir=str(tmp_path), nvml=nvml)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = _fit(callback)
    assert history["gpu0_utilization"] == [40.0, 40.0] and history["gpu1_utilization"] == [41.0, 41.0]
    assert history["gpu0_memory_used_mib"][-1] == 1024 and history["gpu1_memory_total_mib"][-1] == 16 * 1024
    assert history["gpu0_power_w"][-1] == 150.0 and "gpu1_power_w" not in history
    assert history["gpu1_temperature_c"][-1] == 61.0
    # The missing power sensor is warned about once and not asked again.
    power = [w for w in caught if "GPU 1 does not report power_w" in str(w.message)]
    assert len(power) == 1 and nvml.power_reads == 1 + 3  # gpu1 once; gpu0 at begin and two epoch ends
    assert nvml.shut_down
    scalars = _scalars(tmp_path / "device_metrics")
    assert scalars["device/gpu0_utilization"] == [40.0, 40.0, 40.0]  # train begin, two epoch ends
    assert scalars["device/gpu0_temperature_c"][-1] == 60.0
    assert "device/process_memory_mib" in scalars


def test_cpu_readings_are_real_and_a_missing_gpu_source_is_one_warning():
    callback = DeviceMetrics(interval_seconds=3600, nvml=FakeNvml(init_error="Driver Not Loaded"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = _fit(callback)
    messages = [str(w.message) for w in caught if "DeviceMetrics" in str(w.message)]
    assert sum("Driver Not Loaded" in m for m in messages) == 1
    assert sum("TensorFlow has no GPU" in m for m in messages) == 1
    assert not any(key.startswith("gpu") for key in history)
    assert 50 < history["process_memory_mib"][-1] < 64 * 1024  # TensorFlow alone is well over 50 MiB
    assert history["process_cpu_percent"][-1] >= 0 and 0 <= history["host_cpu_percent"][-1] <= 100


def test_the_real_nvml_path_on_a_machine_without_gpus_warns_and_goes_on():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = _fit(DeviceMetrics(interval_seconds=3600), epochs=1)
    assert any("no GPU readings from NVML" in str(w.message) for w in caught)
    assert "process_memory_mib" in history


def test_samples_follow_the_interval_and_show_in_the_progress_bar(capsys):
    callback = DeviceMetrics(interval_seconds=1e-6, nvml=FakeNvml())
    _fit(callback, epochs=1, verbose=1)
    assert callback.samples == 1 + 8 + 1  # train begin, every one of 8 batches, epoch end
    out = capsys.readouterr().out
    assert "gpu0_utilization: 40" in out and "process_memory_mib:" in out


def test_a_bad_interval_is_a_clear_error():
    with pytest.raises(ValueError, match=r"`interval_seconds` must be > 0. Received: 0"):
        DeviceMetrics(interval_seconds=0)


@pytest.mark.slow
def test_config_switch_reports_device_metrics(tmp_path):
    proc, result = train_with_metrics(
        tmp_path, "configs/default.yaml", "train.epochs=1", "callbacks.device_metrics=true",
        f"callbacks.tensorboard_dir={tmp_path / 'tb'}", timeout=300,
    )
    final = result["final"]
    assert final["process_memory_mib"] > 50
    scalars = _scalars(tmp_path / "tb")
    assert "device/process_cpu_percent" in scalars  # DeviceMetrics's own writer
    assert "epoch_process_memory_mib" in scalars  # Keras's TensorBoard saw the epoch's sample
    assert "process_memory_mib:" in proc.stdout
