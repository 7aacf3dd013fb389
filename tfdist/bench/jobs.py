"""Running whole `tfdist train` jobs as benchmark rounds, each in fresh processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Callable, Sequence

__all__ = ["train_job", "train_command"]

JOB_TIMEOUT_SECONDS = 600


def train_command(overrides: Sequence[str], metrics: str) -> list[str]:
    """`python -m tfdist.cli train --metrics_out METRICS --set ...` with this interpreter."""
    command = [sys.executable, "-m", "tfdist.cli", "train", "--metrics_out", metrics]
    for override in overrides:
        command += ["--set", override]
    return command


def train_job(overrides: Sequence[str], launcher: Sequence[str] = (), env: dict | None = None) -> Callable[[], float]:
    """A benchmark round: one `tfdist train` job (under `launcher`, e.g. horovodrun); returns samples/sec.

    Raises:
      RuntimeError: the job failed (with the end of its output).
    """

    def one_round() -> float:
        with tempfile.TemporaryDirectory() as scratch:
            metrics = os.path.join(scratch, "metrics.json")
            job_env = {**os.environ, "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "3", **(env or {})}
            done = subprocess.run([*launcher, *train_command(overrides, metrics)], capture_output=True,
                                  text=True, env=job_env, timeout=JOB_TIMEOUT_SECONDS)
            if done.returncode != 0:
                output = (done.stdout + done.stderr)[-2000:]
                raise RuntimeError(f"benchmark job failed: {' '.join(overrides)}\n{output}")
            with open(metrics) as f:
                return json.load(f)["samples_per_sec"]

    return one_round
