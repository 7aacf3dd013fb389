"""Running whole `tfdist train` jobs as benchmark rounds, each in fresh processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Callable, Sequence

__all__ = ["HOROVODRUN", "ROOT", "described", "horovod_available", "horovod_launcher", "on_core", "run_train",
           "script", "train_job"]

JOB_TIMEOUT_SECONDS = 600
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's
BENCHMARKS = os.path.join(ROOT, "benchmarks")
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")
# Runs the rest of its command line pinned to the core of its local rank
# (Horovod's one process per device, on CPUs); the pinning survives exec.
_PIN_TO_CORE = ("import os, sys; os.sched_setaffinity(0, {int(os.environ['HOROVOD_LOCAL_RANK']) % os.cpu_count()}); "
                "os.execv(sys.argv[1], sys.argv[1:])")


def horovod_available() -> bool:
    """True where Horovod (and its horovodrun) is installed in this environment."""
    return os.path.exists(HOROVODRUN)


def horovod_launcher(np: int) -> list[str]:
    """`horovodrun -np NP` on localhost over Gloo, each rank pinned to its own core."""
    return [HOROVODRUN, "-np", str(np), "-H", f"localhost:{np}", "--gloo", sys.executable, "-c", _PIN_TO_CORE]


def script(name: str) -> str:
    """The path of `benchmarks/NAME`: the hand-written jobs tfdist is raced against live beside the
    package in a source checkout, not inside it.

    Raises:
      RuntimeError: tfdist was installed without its source tree.
    """
    path = os.path.join(BENCHMARKS, name)
    if not os.path.exists(path):
        raise RuntimeError(f"this benchmark runs the hand-written jobs in {BENCHMARKS}/, which a tfdist source "
                           "checkout has and an installed package does not: run it from a clone")
    return path


def on_core(core: int) -> tuple[str, ...]:
    """A launcher that runs the rest of its command line pinned to CPU `core` (the pinning survives exec)."""
    return (sys.executable, "-c", "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])}); "
            "os.execv(sys.argv[2], sys.argv[2:])", str(core))


def run_train(overrides: Sequence[str], metrics: str, launcher: Sequence[str] = (),
              env: dict | None = None, config: str | None = None,
              command: Sequence[str] = ("train",)) -> subprocess.CompletedProcess:
    """Runs `tfdist train [--config CONFIG] --metrics_out METRICS --set ...` (under `launcher`, e.g. horovodrun).

    `command` replaces `train`, e.g. `("launch", "--workers", "2")` for a multi-worker job.

    Raises:
      RuntimeError: the job failed (with the end of its output).
    """
    argv = [*launcher, sys.executable, "-m", "tfdist.cli", *command, "--metrics_out", metrics]
    argv += ["--config", config] if config else []
    for override in overrides:
        argv += ["--set", override]
    job_env = {**os.environ, "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "3", **(env or {})}
    done = subprocess.run(argv, capture_output=True, text=True, env=job_env, timeout=JOB_TIMEOUT_SECONDS)
    if done.returncode != 0:
        raise RuntimeError(f"benchmark job failed: {' '.join(overrides)}\n{(done.stdout + done.stderr)[-2000:]}")
    return done


def train_job(overrides: Sequence[str], launcher: Sequence[str] = (), config: str | None = None,
              command: Sequence[str] = ("train",),
              read: Callable[[dict], Any] = lambda metrics: metrics["samples_per_sec"]) -> Callable[[], Any]:
    """A benchmark round: one `tfdist train` (or `command`) job; returns what `read` takes from its
    `--metrics_out` (its samples/sec unless told)."""

    def one_round() -> Any:
        with tempfile.TemporaryDirectory() as scratch:
            metrics = os.path.join(scratch, "metrics.json")
            run_train(overrides, metrics, launcher, config=config, command=command)
            with open(metrics) as f:
                return read(json.load(f))

    return one_round


def described(jobs: dict[str, Sequence[str]]) -> dict[str, str]:
    """Each job's overrides as the `--set` flags that reproduce it."""
    return {name: " ".join(f"--set {o}" for o in overrides) for name, overrides in jobs.items()}
