"""The machine a benchmark ran on, for its JSON: figures move between CPU models and versions.

Read from `/proc/cpuinfo` (Linux); elsewhere the model is `platform.processor()`
and no flags are listed. The flags kept are those that change how fast
TensorFlow's kernels run here: wide vectors, bfloat16 and AMX. The versions are
the installed distributions' (no import: a benchmark's parent process stays
free of TensorFlow); a missing one is None.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from typing import Any, Optional

__all__ = ["describe"]

FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")
# JSON key -> the distributions that provide it, first installed wins.
PACKAGES = {"tensorflow": ("tensorflow", "tensorflow-cpu", "tf-nightly"), "keras": ("keras",), "horovod": ("horovod",)}


def describe(cpuinfo: str = "/proc/cpuinfo") -> dict[str, Any]:
    """`cpu_model`, `cpu_count`, the `cpu_flags` of FLAGS this CPU has and the `versions` of PACKAGES."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open(cpuinfo, encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
    except OSError:
        pass
    return {"cpu_model": model, "cpu_count": os.cpu_count(), "cpu_flags": [f for f in FLAGS if f in flags],
            "versions": {key: _version(names) for key, names in PACKAGES.items()}}


def _version(distributions: tuple[str, ...]) -> Optional[str]:
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None
