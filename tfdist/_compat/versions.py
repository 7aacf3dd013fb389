"""The TensorFlow and Keras versions tfdist's internals were checked against, and the warning outside them."""

from __future__ import annotations

import importlib.metadata
import warnings
from typing import Mapping, Optional

__all__ = ["TESTED_VERSIONS", "check_versions", "installed_versions", "outside_tested"]

TESTED_VERSIONS = {"tensorflow": "2.21", "keras": "3.15"}  # major.minor


def installed_versions() -> dict[str, str]:
    """Package -> its installed version, for TensorFlow (`tensorflow-cpu` counts as `tensorflow`) and Keras."""
    installed = {}
    for name, distributions in (("tensorflow", ("tensorflow", "tensorflow-cpu")), ("keras", ("keras",))):
        for distribution in distributions:
            try:
                installed[name] = importlib.metadata.version(distribution)
                break
            except importlib.metadata.PackageNotFoundError:
                pass
    return installed


def outside_tested(installed: Mapping[str, str]) -> list[str]:
    """The packages of `installed` whose major.minor is not `TESTED_VERSIONS`', as `name version`."""
    return [f"{name} {version}" for name, version in installed.items()
            if ".".join(version.split(".")[:2]) != TESTED_VERSIONS[name]]


def check_versions(installed: Optional[Mapping[str, str]] = None) -> list[str]:
    """Warns once if TensorFlow or Keras is not the major.minor version tfdist was tested with.

    Args:
      installed: package -> version; default: what is installed (`installed_versions`).

    Returns:
      The packages outside `TESTED_VERSIONS`, as `name version`.
    """
    outside = outside_tested(installed_versions() if installed is None else installed)
    if outside:
        tested = ", ".join(f"{name} {version}" for name, version in TESTED_VERSIONS.items())
        warnings.warn(
            f"tfdist was tested with {tested}; this environment has {', '.join(outside)}. tfdist reaches into "
            "Keras and TensorFlow internals (tfdist._compat), which may have changed: run its tests, or install "
            "the tested versions (pip install 'tfdist[cpu]').",
            stacklevel=2,
        )
    return outside


check_versions()
