"""Runtime set-up that must happen before TensorFlow initialises, and device lists.

TensorFlow fixes its thread pools and logical devices the first time it runs an
op, so `configure_runtime` is the first thing every tfdist entry point calls.
"""

from __future__ import annotations

import tensorflow as tf

from tfdist.config.schema import Config
from tfdist.config.validation import check_devices
from tfdist.errors import ConfigError

__all__ = [
    "configure_runtime", "default_devices", "ensure_logical_cpus", "local_devices", "physical_gpus", "split_cpu",
]


def physical_gpus() -> int:
    """Number of GPUs TensorFlow sees (does not initialise the runtime)."""
    return len(tf.config.list_physical_devices("GPU"))


def ensure_logical_cpus(count: int) -> None:
    """Splits the CPU into at least `count` logical devices.

    Idempotent: asking again for the same or fewer devices is a no-op.

    Raises:
      ConfigError: TensorFlow already initialised with fewer CPU devices.
    """
    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu) or ()
    if len(current) >= count:
        return
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * count
        )
    except RuntimeError:
        have = len(tf.config.list_logical_devices("CPU"))
        if have < count:
            raise ConfigError(
                "strategy.logical_devices",
                f"cannot be raised to {count}: TensorFlow already initialised with "
                f"{have} CPU device(s). Configure tfdist before running any TensorFlow op.",
                count,
            ) from None


def _set_threads(setter, getter, value: int, key: str) -> None:
    if not value or getter() == value:
        return
    try:
        setter(value)
    except RuntimeError:
        raise ConfigError(
            key,
            f"cannot be applied: TensorFlow already initialised with {getter()} threads.",
            value,
        ) from None


def configure_runtime(config: Config) -> int:
    """Applies threads, op determinism and logical CPU devices from config; returns the GPU count.

    Raises:
      ConfigError: the runtime already initialised differently, or
        `strategy.devices` names devices that do not exist.
    """
    threading = tf.config.threading
    _set_threads(
        threading.set_intra_op_parallelism_threads,
        threading.get_intra_op_parallelism_threads,
        config.runtime.intra_op_threads,
        "runtime.intra_op_threads",
    )
    _set_threads(
        threading.set_inter_op_parallelism_threads,
        threading.get_inter_op_parallelism_threads,
        config.runtime.inter_op_threads,
        "runtime.inter_op_threads",
    )
    if config.runtime.deterministic_ops:
        tf.config.experimental.enable_op_determinism()
    gpus = physical_gpus()
    check_devices(config, gpus=gpus)
    if not gpus and config.strategy.spec.local_devices:
        ensure_logical_cpus(config.strategy.logical_devices)
    return gpus


def local_devices(config: Config, gpus: int) -> list[str]:
    """The devices a single-process strategy runs on.

    Explicit `strategy.devices` win; otherwise every GPU, or the logical CPUs.
    """
    if config.strategy.devices:
        return list(config.strategy.devices)
    if gpus:
        return [f"/gpu:{i}" for i in range(gpus)]
    return [f"/cpu:{i}" for i in range(config.strategy.logical_devices)]


def default_devices(needed: int = 1) -> list[str]:
    """Every logical GPU, else every logical CPU: the devices of a strategy given none.

    On a machine without GPUs whose CPU is not yet split into `needed`
    logical devices, splits it first, while TensorFlow has not started.

    Raises:
      ValueError: no GPUs, and TensorFlow already started with fewer than
        `needed` CPU devices (the message says how to get them).
    """
    split_cpu(needed)
    gpus = tf.config.list_logical_devices("GPU")
    return [d.name for d in (gpus or tf.config.list_logical_devices("CPU"))]


def split_cpu(needed: int) -> None:
    """On a machine without GPUs, splits the CPU into `needed` logical devices unless it is already
    (TensorFlow not started: this does not start it, so a cluster can still be joined after).

    Raises:
      ValueError: TensorFlow already started with fewer CPU devices (see `default_devices`).
    """
    if not physical_gpus():
        try:
            ensure_logical_cpus(needed)
        except ConfigError:
            have = len(tf.config.list_logical_devices("CPU"))
            raise ValueError(
                f"this strategy needs {needed} devices and TensorFlow already started with {have} CPU "
                f"device(s) and no GPU. Split the CPU first, before any TensorFlow op runs: "
                f"`tfdist.strategies.devices.ensure_logical_cpus({needed})` (in a config: "
                f"strategy.logical_devices), or pass `devices`."
            ) from None
