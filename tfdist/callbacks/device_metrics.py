"""`DeviceMetrics`: what the devices and the process do while `model.fit` runs.

Every `interval_seconds` (checked at batch ends) and at every epoch end it
takes one sample of:

- each NVIDIA GPU, through NVML (`nvidia-ml-py`, what nvidia-smi reads):
  utilization (%), memory used and total (MiB), power (W), temperature (C);
- each GPU TensorFlow has, TensorFlow's own allocator figures (current and peak
  MiB; TensorFlow keeps none for CPUs);
- this process, through psutil: CPU (% of one core, summed over its threads),
  the machine's CPU (% of all cores) and resident memory (MiB).

The latest sample goes into the Keras logs of every batch and epoch, so the
progress bar, `History` and later callbacks (Keras's TensorBoard) see it. With
`log_dir`, each sample is also written as TensorBoard scalars
(`device/<name>`, stepped by the training step). A source that is missing
(no NVML library or driver, no GPU) gives one warning and the others keep
working; so does a single reading a GPU does not support (power on some
boards).

Example:

    >>> metrics = DeviceMetrics(interval_seconds=5, log_dir="/tmp/tb")
    >>> model.fit(x, y, callbacks=[metrics])  # doctest: +SKIP
    >>> metrics.latest["process_memory_mib"]  # doctest: +SKIP
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any, Callable, Optional

import keras
import psutil
import tensorflow as tf

from tfdist import _compat

__all__ = ["DeviceMetrics"]

_MIB = 1024 * 1024


class DeviceMetrics(keras.callbacks.Callback):
    """Samples device and process metrics into the Keras logs and TensorBoard.

    Args:
      interval_seconds: time between samples during an epoch (one is also
        taken at every epoch end).
      log_dir: write each sample as TensorBoard scalars under
        `log_dir/device_metrics`; None for none.
      nvml: the NVML module to read GPUs with; None imports `pynvml` from
        nvidia-ml-py (tests pass a fake).

    Attributes:
      latest: the last sample, name -> value.
      samples: how many samples were taken.
    """

    def __init__(self, *, interval_seconds: float = 10.0, log_dir: Optional[str] = None, nvml: Any = None):
        super().__init__()
        if interval_seconds <= 0:
            raise ValueError(f"`interval_seconds` must be > 0. Received: {interval_seconds}")
        self.interval_seconds = interval_seconds
        self.log_dir = log_dir
        self._nvml_module = nvml
        self.latest: dict[str, float] = {}
        self.samples = 0
        self._sources: list[Callable[[], dict[str, float]]] = []
        self._writer = None
        self._step = 0
        self._next_sample = 0.0

    def on_train_begin(self, logs=None):
        self._sources = [source for source in (_nvml_source(self._nvml_module), _tf_memory_source()) if source]
        self._sources.append(_process_source())
        if self.log_dir:
            self._writer = tf.summary.create_file_writer(os.path.join(self.log_dir, "device_metrics"))
        self._step = 0
        self._sample()

    def on_train_batch_end(self, batch, logs=None):
        self._step += 1
        if time.monotonic() >= self._next_sample:
            self._sample()
        if logs is not None:
            logs.update(self.latest)

    def on_epoch_end(self, epoch, logs=None):
        self._sample()
        if logs is not None:
            logs.update(self.latest)

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        for source in self._sources:
            getattr(source, "close", lambda: None)()

    def _sample(self) -> None:
        sample: dict[str, float] = {}
        for source in self._sources:
            sample.update(source())
        self.latest = sample
        self.samples += 1
        self._next_sample = time.monotonic() + self.interval_seconds
        if self._writer is not None:
            with self._writer.as_default(step=self._step):
                for name, value in sample.items():
                    tf.summary.scalar(f"device/{name}", value)
            self._writer.flush()


class _NvmlSource:
    """Every NVIDIA GPU's readings through NVML; a reading a GPU lacks is warned about once and dropped."""

    def __init__(self, nvml):
        self.nvml = nvml
        nvml.nvmlInit()
        self.handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        self.readings: dict[str, Callable[[Any], float]] = {
            "utilization": lambda h: float(nvml.nvmlDeviceGetUtilizationRates(h).gpu),
            "memory_used_mib": lambda h: nvml.nvmlDeviceGetMemoryInfo(h).used / _MIB,
            "memory_total_mib": lambda h: nvml.nvmlDeviceGetMemoryInfo(h).total / _MIB,
            "power_w": lambda h: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0,  # NVML reports milliwatts
            "temperature_c": lambda h: float(nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)),
        }
        self.missing: set[tuple[int, str]] = set()

    def __call__(self) -> dict[str, float]:
        sample = {}
        for index, handle in enumerate(self.handles):
            for name, read in self.readings.items():
                if (index, name) in self.missing:
                    continue
                try:
                    sample[f"gpu{index}_{name}"] = read(handle)
                except self.nvml.NVMLError as error:
                    self.missing.add((index, name))
                    warnings.warn(f"DeviceMetrics: GPU {index} does not report {name} ({error}); left out.")
        return sample

    def close(self) -> None:
        self.nvml.nvmlShutdown()


def _nvml_source(nvml) -> Optional[_NvmlSource]:
    try:
        nvml = nvml or _compat.nvml()
    except ImportError as error:
        warnings.warn(f"DeviceMetrics: no GPU readings from NVML: {error}")
        return None
    try:
        source = _NvmlSource(nvml)
    except nvml.NVMLError as error:  # no driver or no NVIDIA GPU
        warnings.warn(f"DeviceMetrics: no GPU readings from NVML ({error}); CPU and process readings go on.")
        return None
    if not source.handles:
        warnings.warn("DeviceMetrics: NVML sees no GPU; CPU and process readings go on.")
        source.close()
        return None
    return source


def _tf_memory_source() -> Optional[Callable[[], dict[str, float]]]:
    gpus = [device.name for device in tf.config.list_logical_devices("GPU")]
    if not gpus:
        warnings.warn("DeviceMetrics: TensorFlow has no GPU, so no allocator memory figures (it keeps none for CPUs).")
        return None

    def sample() -> dict[str, float]:
        values = {}
        for index, name in enumerate(gpus):
            info = tf.config.experimental.get_memory_info(name)
            values[f"gpu{index}_tf_memory_mib"] = info["current"] / _MIB
            values[f"gpu{index}_tf_peak_memory_mib"] = info["peak"] / _MIB
        return values

    return sample


def _process_source() -> Callable[[], dict[str, float]]:
    process = psutil.Process()
    process.cpu_percent(None)  # the first call starts the interval
    psutil.cpu_percent(None)

    def sample() -> dict[str, float]:
        return {
            "process_cpu_percent": process.cpu_percent(None),
            "host_cpu_percent": psutil.cpu_percent(None),
            "process_memory_mib": process.memory_info().rss / _MIB,
        }

    return sample
