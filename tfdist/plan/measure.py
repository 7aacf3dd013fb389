"""`tfdist plan --measure`: this machine's own times for the config's model, on one device.

`MeasuredTimes(one_device, model)` trains the job on one device
(`one_device_config`: a device's share of the batch) and times, in
alternated rounds:

- its training step: the device's rate, the model's training FLOPs over it
  (`device_flops`), which the planner scales to every layout's batch;
- the model's forward and backward alone, compiled, at the same batch: what
  the step does besides them (the optimizer's update, the loss and metrics,
  Keras's own work a step) is `rest_ms`, which a step pays once whatever its
  micro-batches.

A pipeline's stages are timed when the planner asks for them
(`stage_ms`): the model cut as the job cuts it (`tfdist.parallel.partition.
split`, with the config's boundaries or balance), each stage's forward and
backward, compiled, on one micro-batch, less what calling a compiled
function costs with nothing in it. On a CPU a small micro-batch costs far
more than its share of the FLOPs (every op has a fixed cost), so a pipeline
predicted from the FLOPs rate is off by as much as its micro-batches are
small; the stages' own times carry it.

Every round also reads the process's CPU time: the cores a step or a stage
keeps busy, which bound a step on devices that share a machine's cores
(`Cluster.host_cores`).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Optional, Sequence

from tfdist.errors import ConfigError

__all__ = ["MeasuredTimes", "one_device_config", "shared_cores"]

ROUNDS = 5  # alternated timed rounds: a training step's median, a compiled call's fastest
STEPS = 10  # training steps, or compiled calls, a round
EMPTY = "empty call"


def shared_cores() -> int:
    """The cores this machine's devices share when they are logical CPU devices (no GPU): those this
    process may run on; 0 with GPUs, each of which computes on its own."""
    import os

    from tfdist.strategies.devices import physical_gpus

    return 0 if physical_gpus() else len(os.sched_getaffinity(0))


def one_device_config(config, batch: int):
    """`config` as a one-device job of `batch` examples a step: what `MeasuredTimes` times."""
    from tfdist.config import to_dict
    from tfdist.config.loading import from_dict

    raw = to_dict(config)
    raw["strategy"].update(kind="one_device", logical_devices=1, devices=[], shard_optimizer=0)
    raw["train"]["global_batch_size"] = batch
    return from_dict(raw)


class MeasuredTimes:
    """This machine's times for `one_device`'s job (call after the runtime is set up as the job's).

    Attributes:
      batch: the examples of the timed step.
      step_ms: the one-device training step.
      forward_backward_ms: the model's forward and backward alone, at the same batch (the work of a
        compiled call of them: less the cost of calling it).
      rest_ms: what the step does once besides them (the optimizer's update, loss, metrics).
      parallelism: the cores the step keeps busy on average (the process's CPU time over its time).
      device_flops: the model's training FLOPs in the step, over its time.
      other_ms: the medians of `other_rounds`, timed in the same alternated rounds.

    `starts`: where a pipeline's stages after the first start (positions in the model's layer graph),
    when a job's own cut is known; otherwise the model is cut as the job would cut it.
    """

    def __init__(self, one_device, model, *, other_rounds: Optional[dict[str, Callable[[], float]]] = None,
                 rounds: int = ROUNDS, starts: Sequence[int] = ()):
        from tfdist import training
        from tfdist.callbacks.throughput import fit_round

        self._config, self._rounds, self._starts = one_device, rounds, list(starts)
        self.batch = one_device.train.global_batch_size
        self._job = training.prepare(one_device)
        self._model = self._job.model
        whole = _forward_backward(self._model, self._model.inputs, self.batch)
        if whole is None:
            raise ConfigError("--measure", "needs the model's input shape: its inputs' shapes are not all known.",
                              [tuple(t.shape) for t in self._model.inputs])
        step = fit_round(self._model, self._job.train_data, batch=self.batch, steps=STEPS)
        timed = self._timed({"step": step, **(other_rounds or {})}, {"forward_backward": whole})
        self.step_ms, self.parallelism = timed.pop("step")
        self.forward_backward_ms, _ = timed.pop("forward_backward")
        self.rest_ms = max(0.0, self.step_ms - self.forward_backward_ms)
        self.device_flops = model.training_flops_per_example * self.batch / (self.step_ms / 1000)
        self.other_ms = {name: ms for name, (ms, _) in timed.items()}
        self._stages: dict[tuple[int, int], list[tuple[float, float]]] = {}

    def stage_ms(self, stages: int, micro_batch: int) -> list[float]:
        """Each stage's forward and backward on one micro-batch, compiled, when the model is cut into
        `stages` as the job cuts it (less an empty compiled call's cost, which a step pays once); empty
        when a stage cannot be timed (an input of unknown shape between stages)."""
        return [ms for ms, _ in self._stage_times(stages, micro_batch)]

    def stage_cpu_ms(self, stages: int, micro_batch: int) -> list[float]:
        """The CPU time of each stage's slot (`stage_ms`): its time times the cores it kept busy."""
        return [ms * cores for ms, cores in self._stage_times(stages, micro_batch)]

    def _stage_times(self, stages: int, micro_batch: int) -> list[tuple[float, float]]:
        from tfdist.parallel.partition import split

        key = (stages, micro_batch)
        if key not in self._stages:
            pipeline = self._config.pipeline
            boundaries = next((cut for cut in (self._starts, list(pipeline.boundaries)) if len(cut) == stages - 1),
                              None)
            partition = split(self._model, stages, boundaries=boundaries, balance_by=pipeline.balance_by.value,
                              micro_batch_size=micro_batch)
            calls = {f"stage {stage.index}": _forward_backward(stage.model, stage.consumes, micro_batch)
                     for stage in partition.stages}
            self._stages[key] = list(self._timed({}, calls).values()) if None not in calls.values() else []
        return self._stages[key]

    def to_dict(self) -> dict[str, Any]:
        timed = {f"{stages} stages, micro-batch {micro}": (stages, micro) for stages, micro in self._stages}
        return {"batch": self.batch, "step_ms": self.step_ms, "forward_backward_ms": self.forward_backward_ms,
                "rest_ms": self.rest_ms, "device_flops": self.device_flops, "parallelism": self.parallelism,
                "stage_ms": {name: self.stage_ms(*key) for name, key in timed.items()},
                "stage_cpu_ms": {name: self.stage_cpu_ms(*key) for name, key in timed.items()}}

    def _timed(self, rounds: dict[str, Callable[[], float]],
               calls: dict[str, Any]) -> dict[str, tuple[float, float]]:
        """For `rounds` and the compiled `calls`, all in the same alternated rounds: the median ms of a
        round, and the median cores kept busy (the process's CPU time over the round's wall time). A call's
        ms is its fastest round less an empty compiled call's fastest (which a step pays once): a stage
        can cost a fraction of a millisecond more than the empty call, and other work on the machine only
        adds time, so medians of a loaded machine can put it at or below nothing."""
        import tensorflow as tf

        from tfdist.timing import alternate

        timed = {**rounds, **{name: _call_round(call) for name, call in calls.items()},
                 EMPTY: _call_round(tf.function(lambda: tf.constant(0.0)))}
        samples = alternate({name: _with_cores(one_round) for name, one_round in timed.items()}, repeats=self._rounds)
        times = {name: ((min if name in calls or name == EMPTY else statistics.median)(ms for ms, _ in values),
                        statistics.median(cores for _, cores in values)) for name, values in samples.items()}
        empty, _ = times.pop(EMPTY)
        return {name: (max(0.0, ms - empty) if name in calls else ms, cores) for name, (ms, cores) in times.items()}


def _forward_backward(model, inputs, batch: int):
    """`partition.forward_backward` of `model` on a random batch, compiled; None when an input's shape
    is not all known."""
    import tensorflow as tf

    from tfdist.parallel.partition import forward_backward, random_inputs

    sample = random_inputs(inputs, batch)
    if sample is None:  # an input of unknown shape: nothing to time it on
        return None
    return tf.function(lambda: forward_backward(model, sample))


def _with_cores(one_round: Callable[[], float]) -> Callable[[], tuple[float, float]]:
    """`one_round`, returning what it measured and the cores the process kept busy meanwhile."""

    def measured() -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        value = one_round()
        return value, (time.process_time() - cpu) / max(time.perf_counter() - wall, 1e-9)

    return measured


def _call_round(function) -> Callable[[], float]:
    """A round for `alternate`: `STEPS` calls of a compiled `function`; ms a call, once its results are in."""

    def one_round() -> float:
        start = time.perf_counter()
        for _ in range(STEPS):
            results = function()
        for result in results if isinstance(results, list) else [results]:
            result.numpy()  # the calls run ahead of Python: wait for the last one's work
        return 1000 * (time.perf_counter() - start) / STEPS

    return one_round
