"""The training job behind `tfdist train`: config -> strategy -> model.fit -> report.

It is plain Keras under a strategy's scope, the same code a user writes (see
`examples/train_digits.py`); `prepare` is separate from `run` so that benchmarks
time exactly the job `tfdist train` runs.

Example:

    >>> import tfdist
    >>> cfg = tfdist.load_config("configs/default.yaml", ["train.epochs=1"])
    >>> result = run(cfg)  # doctest: +SKIP
    >>> result["final"]["val_accuracy"]  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
from typing import Any, Optional, TextIO

import keras
import tensorflow as tf

from tfdist import data, models, precision
from tfdist.callbacks import (Checkpoint, DeviceMetrics, InputStalls, Preemption, Throughput,
                              weights_digest)
from tfdist.config.environment import HOST_INTERFACE_ENV
from tfdist.config.schema import Config, ModelName
from tfdist.config.validation import check_job, check_transformer_split
from tfdist.contract import contract
from tfdist.data.sources import shard, with_count
from tfdist.errors import ConfigError
from tfdist.optimizers import build_optimizer
from tfdist.parallel.recompute import remat
from tfdist.reporting import format_summary, write_json
from tfdist.strategies.factory import make_strategy, serves_only

__all__ = ["Job", "is_chief", "prepare", "run"]


@dataclasses.dataclass
class Job:
    """Everything `model.fit` needs, built from one config.

    Attributes:
      config: the config it was built from.
      strategy: the distribution strategy.
      model: the compiled model (built under `strategy.scope()`).
      train_data: repeated training batches of `global_batch_size`.
      val_data: the validation batches.
      steps_per_epoch: training steps per epoch.
      input_sharding: how a multi-process job splits the input: `file`,
        `record`, or `none` (one process).
    """

    config: Config
    strategy: tf.distribute.Strategy
    model: keras.Model
    train_data: tf.data.Dataset
    val_data: Optional[tf.data.Dataset]
    steps_per_epoch: int
    input_sharding: str = "none"


def prepare(config: Config, strategy: Optional[tf.distribute.Strategy] = None) -> Job:
    """Builds the strategy (unless given), data and compiled model from config.

    Raises:
      ConfigError: the data or model the config names cannot be read, imported
        or built, or do not fit each other.
    """
    check_job(config)
    strategy = strategy or make_strategy(config)
    answers = contract(strategy)
    if answers.model_axis > 1 and config.model.name == ModelName.TRANSFORMER.value:
        check_transformer_split(config, answers.model_axis)
    train = config.train
    keras.utils.set_random_seed(train.seed)
    source = data.load_source(config.data, seed=train.seed, steps_per_epoch_set=bool(train.steps_per_epoch))
    steps = train.steps_per_epoch or data.steps_per_epoch(source.train.count, train.global_batch_size)

    def build_model():
        return models.build(config.model, input_shape=source.input_shape, num_classes=source.num_classes)

    # What a strategy needs before the model is built, and the config errors it can see in the model.
    answers.before_build(build_model)
    keras.utils.set_random_seed(train.seed)  # a probe build may have drawn from it; the model starts as without
    with strategy.scope():
        model = build_model()
        answers.check_model(model)
        try:
            remat(model, train.remat)
        except ValueError as error:
            raise ConfigError("train.remat", str(error).removeprefix("`layers` "), train.remat) from None
        optimizer = build_optimizer(train, steps_per_epoch=steps, accumulation_steps=answers.accumulation_steps)
        model.compile(
            optimizer=precision.wrap_optimizer(optimizer, config.precision),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
            auto_scale_loss=False,  # wrap_optimizer already decided on loss scaling
            steps_per_execution=answers.steps_per_execution,
        )
    train_data, val_data, sharding = _input(config, strategy, source)
    return Job(config=config, strategy=strategy, model=model, train_data=train_data, val_data=val_data,
               steps_per_epoch=steps, input_sharding=sharding)


def _input(config: Config, strategy: tf.distribute.Strategy, source: data.Source):
    """The training and validation batches, and how a multi-process job splits them."""
    answers = contract(strategy)
    workers, index = answers.input_workers()
    train_examples, sharding = shard(source.train, workers, index)
    pipeline = config.data
    if not pipeline.shuffle_buffer and source.train.count:  # shuffle over the whole training set
        pipeline = dataclasses.replace(pipeline, shuffle_buffer=source.train.count)
    batch = config.train.global_batch_size
    train_data = data.input_pipeline(train_examples, pipeline, batch_size=batch, training=True,
                                     seed=config.train.seed)
    val_data = None
    if source.validation is not None:
        validation = source.validation
        if answers.input_built_by_chief and validation.count is None:
            # The chief (parameter servers) evaluates: it reads the set whole and must know its size.
            validation = with_count(validation)
        val_examples, _ = shard(validation, workers, index)
        val_data = data.input_pipeline(val_examples, pipeline, batch_size=batch, training=False)
    files = f", {source.train.files} files" if source.train.files else ""  # arrays and user datasets list none
    described = f"{sharding} ({workers} input pipelines{files})" if workers > 1 else sharding
    return train_data, val_data, described


def is_chief(strategy: tf.distribute.Strategy) -> bool:
    """True in a single-process job, in the chief task of a multi-worker one, and on Horovod's rank 0."""
    return contract(strategy).is_chief


def _callbacks(job: Job) -> tuple[Throughput, Optional[InputStalls], Optional[Checkpoint],
                                   list[keras.callbacks.Callback]]:
    cfg = job.config.callbacks
    throughput = Throughput(
        job.config.train.global_batch_size, warmup_steps=cfg.throughput_warmup_steps,
        link=os.environ.get(HOST_INTERFACE_ENV),  # on a namespace host of `tfdist launch --hosts`
    )
    callbacks: list[keras.callbacks.Callback] = [throughput]
    chief = is_chief(job.strategy)
    if cfg.device_metrics:  # before TensorBoard, which then also logs the epoch's samples
        log_dir = cfg.tensorboard_dir if chief else None
        callbacks.append(DeviceMetrics(interval_seconds=cfg.device_metrics_interval_seconds, log_dir=log_dir))
    stalls = None
    if cfg.input_stalls and chief:  # the profile goes beside TensorBoard's logs, for its Profile tab
        stalls = InputStalls(start_step=cfg.throughput_warmup_steps, steps=cfg.input_stalls_steps,
                             log_dir=cfg.tensorboard_dir, verbose=False)  # reported in the summary
        callbacks.append(stalls)
    if cfg.tensorboard_dir and chief:
        callbacks.append(keras.callbacks.TensorBoard(cfg.tensorboard_dir))
    if cfg.backup_dir:  # every process resumes from the backup; only the chief writes it (`_compat.patches`)
        callbacks.append(keras.callbacks.BackupAndRestore(cfg.backup_dir))
    checkpoint = None
    c = job.config.checkpoint
    if c.dir:  # every process resumes; only the chief writes
        checkpoint = Checkpoint(c.dir, every_steps=c.every_steps, every_seconds=c.every_seconds, keep=c.keep,
                                grace_seconds=c.grace_seconds, write=chief)
        callbacks.append(checkpoint)
    else:  # a scheduler's SIGTERM still stops the job, in every process at one step
        callbacks.append(Preemption(grace_seconds=c.grace_seconds))
    return throughput, stalls, checkpoint, callbacks


def run(
    config: Config, *, metrics_out: Optional[str] = None, out: Optional[TextIO] = None
) -> dict[str, Any]:
    """Trains from config, prints the summary and returns (and saves) the results.

    Args:
      config: the job.
      metrics_out: write the results here as JSON (chief only).
      out: where the summary goes (default: `sys.stdout` when the summary is printed, so that a redirection
        such as `contextlib.redirect_stdout` takes it).

    Returns:
      `strategy`, `devices`, `num_replicas`, `global_batch_size`, `precision`,
      `samples_per_sec`, `step_time_ms`, `epochs`, `steps_per_epoch`,
      `trainable_bytes`, `final` (the last epoch's Keras logs) and
      `host_cpu_busy` (the share of the machine's cores busy over the
      measured steps); on a namespace host, `link_bytes_per_step` and
      `link_retransmits_per_step` (TCP segments sent again).

    Raises:
      ClusterError: a multi-worker job lost a task, or a Horovod job a rank.
    """
    if serves_only(config):
        return {}  # a worker or parameter server: served until the chief's job ended
    job = prepare(config)
    answers = contract(job.strategy)
    throughput, stalls, checkpoint, callbacks = _callbacks(job)
    chief = is_chief(job.strategy)
    fit = functools.partial(
        job.model.fit,
        job.train_data,
        steps_per_epoch=job.steps_per_epoch,
        validation_data=job.val_data,
        shuffle=False,  # the dataset shuffles itself
        verbose=config.train.verbose if chief else 0,
    )
    try:
        history = answers.fit(job.model, fit, epochs=config.train.epochs, callbacks=callbacks)
    except tf.errors.OpError as e:
        # A strategy that can tell a lost peer from other failures says so in one line.
        lost = answers.job_error(e)
        if lost is not None:
            raise lost from e
        raise
    chief = answers.is_chief  # after an elastic reset, rank 0 may be another process
    if checkpoint is not None and checkpoint.resumed_from_step and not history.history:
        if chief:  # a rerun of a finished job: its results stand
            print(f"tfdist: nothing to train: the checkpoint in {checkpoint.store.directory} is of step "
                  f"{checkpoint.resumed_from_step}, where this job's training ends"
                  + (f"; {metrics_out} is left as the finished run wrote it" if metrics_out else ""), file=out)
        return {"resumed_from_step": checkpoint.resumed_from_step, "nothing_to_train": True}
    final = {name: float(values[-1]) for name, values in history.history.items()}
    result = {
        "strategy": config.strategy.kind,
        "devices": answers.devices,
        "num_replicas": job.strategy.num_replicas_in_sync,
        "global_batch_size": config.train.global_batch_size,
        "precision": config.precision.policy.value,
        "samples_per_sec": throughput.samples_per_sec,
        "step_time_ms": throughput.step_time_ms,
        "epochs": config.train.epochs,
        "steps_per_epoch": job.steps_per_epoch,
        "input_sharding": job.input_sharding,
        "final": final,
        "resumed_from_step": checkpoint.resumed_from_step if checkpoint else 0,
        "final_weights_digest": weights_digest(job.model),
        # What one replica's gradients weigh, as the all-reduce or a parameter server moves them.
        "trainable_bytes": sum(math.prod(v.shape) * tf.as_dtype(v.dtype).size for v in job.model.trainable_variables),
    }
    if throughput.host_cpu_busy is not None:
        result["host_cpu_busy"] = throughput.host_cpu_busy
    if throughput.link_bytes_per_step is not None:
        result["link_bytes_per_step"] = throughput.link_bytes_per_step
        result["link_retransmits_per_step"] = throughput.link_retransmits_per_step
    if stalls is not None and stalls.report:
        result["input_wait_share"] = stalls.input_wait_share
        result["input_stalls"] = stalls.report
    # What the strategy adds: its cluster, partition, device groups, placement.
    result.update(answers.job_report(job.model))
    if chief:
        print(format_summary(result), file=out or sys.stdout)
        if metrics_out:
            write_json(metrics_out, result)
    return result
