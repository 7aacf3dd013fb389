"""`tfdist bench baselines`: each multi-device kind against the same job written by hand.

For every kind, tfdist's job and the hand-written one (`benchmarks/handwritten.py`,
the way TensorFlow's and Horovod's docs write it) train the same model (the
digits CNN, width 32) on the same data with the same batch per replica, threads
(intra-op 1, inter-op 2, OMP 1), cluster and steps (8 warm-up, then 400 timed:
shorter windows, under a second, spread by 10% between rounds).
Rounds alternate (tfdist, hand-written, hand-written, tfdist, ...), each a whole
job in fresh processes; each round's figure is its wall-clock samples/sec over
the timed steps.

- `mirrored`: `tfdist bench overhead` (4 logical devices in this process).
- `multi_worker`: 2 tasks on loopback, task i pinned to core i on both sides
  (unpinned, rounds of either job spread by 15%); tfdist's tasks are
  `tfdist train` with `cluster.workers` and `cluster.task_index`, the
  hand-written ones get their own TF_CONFIG.
- `parameter_server`: 1 parameter server + 2 workers as local processes (one
  intra-op thread each), 4 steps per scheduled function on both sides.
- `horovod`: 2 ranks under `horovodrun --gloo`, each pinned to its own core.

Figures: `KIND_ratio` = median samples/sec of tfdist's job / the hand-written
job's (target >= 0.98). For Horovod, `horovod_step_parts_vs_handwritten` says
where the difference goes: in one 2-rank job (`benchmarks/horovod_step_parts.py`)
`fit`, the training function fit calls (tfdist's), Keras's own training
function, a custom loop under tfdist's HorovodStrategy and the hand-written
step take turns, each over the hand-written step's samples/sec.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Callable, Sequence

from tfdist.bench import overhead
from tfdist.bench.jobs import JOB_TIMEOUT_SECONDS, described, horovod_launcher, on_core, script, train_job
from tfdist.timing import alternate, medians
from tfdist.cluster.loopback import free_loopback_ports

__all__ = ["KINDS", "horovod_step_parts", "measure"]

TARGET = 0.98
KINDS = ("mirrored", "multi_worker", "parameter_server", "horovod")
THREADS = ["runtime.intra_op_threads=1", "runtime.inter_op_threads=2"]


def measure(*, repeats: int = 5, kinds: Sequence[str] = KINDS, per_replica_batch: int = 64, width: int = 32,
            warmup: int = 8, steps: int = 400, steps_per_function: int = 4) -> dict[str, Any]:
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"`kinds` must be among {KINDS}. Received: {sorted(unknown)}")
    common = ["train.verbose=0", "train.epochs=1", f"train.steps_per_epoch={warmup + steps}",
              f"callbacks.throughput_warmup_steps={warmup}", "model.name=digits_cnn", f"model.width={width}",
              "train.optimizer=adam", "train.learning_rate=0.002", *THREADS]
    handwritten = ["--per_replica_batch", str(per_replica_batch), "--width", str(width), "--warmup", str(warmup),
                   "--steps", str(steps), "--steps_per_function", str(steps_per_function)]
    overrides = {
        "multi_worker": ["strategy.kind=multi_worker_mirrored", f"train.global_batch_size={2 * per_replica_batch}"],
        "parameter_server": ["strategy.kind=parameter_server", f"train.global_batch_size={per_replica_batch}",
                             "parameter_server.num_workers=2", "parameter_server.num_ps=1",
                             "parameter_server.threads_per_task=1",
                             f"parameter_server.steps_per_execution={steps_per_function}"],
        "horovod": ["strategy.kind=horovod", f"train.global_batch_size={2 * per_replica_batch}"],
    }
    results: dict[str, Any] = {}
    figures: dict[str, Any] = {"target": TARGET}
    for kind in kinds:
        if kind == "mirrored":
            result = overhead.run(repeats=repeats)
            rate = result["samples_per_sec"]
            results[kind] = {"samples_per_sec": rate, "overhead": result["figures"]}
        else:
            job = common + overrides[kind]
            tfdist_round, handwritten_job = _ROUNDS[kind]
            samples = alternate({"tfdist": tfdist_round(job), "handwritten": lambda: handwritten_job(handwritten)},
                                repeats=repeats, warmup=0)
            rate = medians(samples)
            results[kind] = {"samples_per_sec": rate, "samples": samples, "tfdist_job": described({kind: job})[kind],
                             "handwritten_flags": " ".join(handwritten)}
        figures[f"{kind}_ratio"] = rate["tfdist"] / rate["handwritten"]
        if kind == "horovod":
            parts = horovod_step_parts(common + overrides[kind], repeats=repeats, steps=steps)
            results[kind]["step_parts"] = parts
            part_rate = medians(parts)
            figures["horovod_step_parts_vs_handwritten"] = {
                name: value / part_rate["handwritten"] for name, value in part_rate.items() if name != "handwritten"}
    figures["meets_target"] = all(figures[f"{kind}_ratio"] >= TARGET for kind in kinds)
    return {"benchmark": "baselines", "repeats": repeats, "per_replica_batch": per_replica_batch,
            "warmup_steps": warmup, "timed_steps": steps, "kinds": results, "figures": figures}


def horovod_step_parts(job: list[str], *, repeats: int, steps: int) -> dict[str, list[float]]:
    """Samples/sec of each timing of `benchmarks/horovod_step_parts.py`, from one 2-rank job."""
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "parts.json")
        argv = [*horovod_launcher(2), sys.executable, script("horovod_step_parts.py"), out, str(repeats),
                str(steps), *job]
        _run_processes([(argv, _environment())], "the Horovod step-parts job")
        with open(out) as f:
            return json.load(f)


def _run_processes(commands: list[tuple[list[str], dict]], what: str) -> None:
    """Runs every (argv, env) at once; raises RuntimeError with the output of the first that fails."""
    processes = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for argv, env in commands]
    try:
        for process in processes:
            output, _ = process.communicate(timeout=JOB_TIMEOUT_SECONDS)
            if process.returncode != 0:
                raise RuntimeError(f"{what} failed:\n{output[-3000:]}")
    finally:
        for process in processes:
            process.kill()


def _environment(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "3", **extra}


def _two_workers_tf_config() -> list[str]:
    workers = [f"127.0.0.1:{p}" for p in free_loopback_ports(2)]
    return [json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}) for i in range(2)]


def _handwritten_job(kind: str, flags: list[str], commands: Callable[[list[str]], list[tuple[list[str], dict]]]
                     ) -> float:
    """Runs the hand-written job `kind` as the processes `commands(argv)` gives; returns its samples/sec."""
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "out.json")
        argv = [sys.executable, script("handwritten.py"), "--kind", kind, "--out", out, *flags]
        _run_processes(commands(argv), f"the hand-written {kind} job")
        with open(out) as f:
            return json.load(f)["samples_per_sec"]


def _tfdist_multi_worker(overrides: list[str]) -> Callable[[], float]:
    """A round: `tfdist train` as 2 tasks of one cluster, task i pinned to core i (as the hand-written job)."""

    def one_round() -> float:
        with tempfile.TemporaryDirectory() as scratch:
            metrics = os.path.join(scratch, "metrics.json")
            workers = ", ".join(f"127.0.0.1:{p}" for p in free_loopback_ports(2))
            commands = []
            for index in range(2):
                argv = [*on_core(index), sys.executable, "-m", "tfdist.cli", "train", "--metrics_out", metrics]
                for override in [*overrides, f"cluster.workers=[{workers}]", f"cluster.task_index={index}"]:
                    argv += ["--set", override]
                commands.append((argv, _environment()))
            _run_processes(commands, "the tfdist multi-worker job")
            with open(metrics) as f:
                return json.load(f)["samples_per_sec"]

    return one_round


def _multi_worker(flags: list[str]) -> float:
    return _handwritten_job("multi_worker", flags, lambda argv: [
        ([*on_core(i), *argv], _environment(TF_CONFIG=tf_config)) for i, tf_config in enumerate(_two_workers_tf_config())
    ])


def _parameter_server(flags: list[str]) -> float:
    from tfdist.cluster.servers import LocalCluster

    # The same local servers tfdist's job starts for itself: plain tf.distribute.Server processes.
    with LocalCluster(2, 1, threads=1, restart_workers=False) as cluster:
        tf_config = json.dumps({"cluster": cluster.cluster_spec, "task": {"type": "chief", "index": 0}})
        return _handwritten_job("parameter_server", flags, lambda argv: [(argv, _environment(TF_CONFIG=tf_config))])


def _horovod(flags: list[str]) -> float:
    return _handwritten_job("horovod", flags, lambda argv: [([*horovod_launcher(2), *argv], _environment())])


# kind -> (tfdist's round for a job's overrides, the hand-written job for its flags)
_ROUNDS = {
    "multi_worker": (_tfdist_multi_worker, _multi_worker),
    "parameter_server": (train_job, _parameter_server),
    "horovod": (lambda job: train_job(job, launcher=horovod_launcher(2)), _horovod),
}
