"""Peak bytes from TensorFlow's CPU allocator on every CPU, for the benchmarks that measure memory.

TensorFlow keeps allocation statistics on CPUs only through oneDNN's allocator, which it turns on by default
only on CPUs with AVX-512 (VNNI/BF16) or AMX. Elsewhere (an AVX2 CPU, or `TF_ENABLE_ONEDNN_OPTS=0` anywhere)
`tf.config.experimental.get_memory_info("CPU:0")` raises "Allocator stats not available". TensorFlow's own
`TF_CPU_ALLOCATOR_USE_BFC=true`, read when the process first allocates on the CPU, makes the CPU allocator its
BFC allocator (the GPUs' kind), which keeps them with or without oneDNN: the same allocator, and so the same
kind of figure, on every machine. It rounds each allocation up to its bins (256 bytes and up), so its peaks
are a little above oneDNN's. A GPU's allocator keeps its statistics anyway.

    allocator.count_allocations()          # before TensorFlow's first CPU allocation in this process
    allocator.reset_peak()
    ...                                    # the work measured
    allocator.peak_bytes() - before
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["VARIABLE", "count_allocations", "current_bytes", "describe", "peak_bytes", "reset_peak"]

VARIABLE = "TF_CPU_ALLOCATOR_USE_BFC"


def count_allocations() -> None:
    """Makes this process's CPU allocator one that keeps statistics. Call before TensorFlow first allocates
    on the CPU (importing it does not)."""
    os.environ[VARIABLE] = "true"


def _memory_info(device: str) -> dict[str, int]:
    import tensorflow as tf

    try:
        return tf.config.experimental.get_memory_info(device)
    except ValueError as error:
        raise RuntimeError(
            f"TensorFlow keeps no allocation statistics for `{device}` in this process: call "
            f"tfdist.bench.allocator.count_allocations() (or set {VARIABLE}=true) before it first allocates. "
            f"Received: {error}") from None


def current_bytes(device: str = "CPU:0") -> int:
    """The bytes `device`'s allocator holds now."""
    return _memory_info(device)["current"]


def peak_bytes(device: str = "CPU:0") -> int:
    """The most bytes `device`'s allocator held at once since the last `reset_peak`."""
    return _memory_info(device)["peak"]


def reset_peak(device: str = "CPU:0") -> None:
    """Starts `device`'s peak again from what it holds now."""
    import tensorflow as tf

    _memory_info(device)  # the same clear error where there are no statistics
    tf.config.experimental.reset_memory_stats(device)


def describe() -> dict[str, Any]:
    """What measured the peaks, for a benchmark's JSON."""
    return {"allocator": "bfc" if os.environ.get(VARIABLE, "").lower() in ("1", "true") else "tensorflow's default",
            VARIABLE: os.environ.get(VARIABLE), "TF_ENABLE_ONEDNN_OPTS": os.environ.get("TF_ENABLE_ONEDNN_OPTS")}
