"""What a process may still allocate, and a training state that would not fit in it, refused in one line.

A process capped by a cgroup (a container's or a scheduler's memory limit,
Kubernetes' `resources.limits.memory`, Slurm's `--mem`) that allocates past
its cap is killed by the kernel with SIGKILL: no message, no traceback. A
training job allocates most of its memory when Keras builds the optimizer and
runs the first step: the optimizer's slots and the gradients, on each of the
process's devices. So before the optimizer is built (`guard_optimizer_build`),
the memory those will take is estimated from the model's trainable variables
and the optimizer's slots per weight, and compared with what the process's
cgroup still allows (cgroup v2 `memory.max`, or v1 `memory.limit_in_bytes`,
the tightest of its own and its ancestors', less what the cgroup uses beyond
its file cache). A state that does not fit is a `MemoryLimitError` naming the
bytes and what splits them (`shard_optimizer`). Without a cgroup limit nothing
is checked.

The estimate, for W bytes of trainable weights (each copy this process holds:
a mirrored variable once per device), k slots per weight and N replicas, counts what a training step holds at its
peak, as measured on CPUs (a 100M-weight transformer under Adam took 2.8 GB
more than its weights unsplit and 0.8 GB at stage 3 over 2 processes): the
slots twice (the state and one update's temporaries), k*W unsplit and k*W/N
split; the gradients three times (each gradient, and the packed input and
output of its all-reduce), 3W, or at `shard_optimizer` 2, 2W + W/N (the
reduce-scatter's output is a slice); at 3, where the split weights (S bytes of
W) are slices, S/N of their gradients and three times the whole ones' and the
largest split variable's (gathered), less the S - S/N of weights the split
frees.
"""

from __future__ import annotations

import math
import os
from typing import Optional

from tfdist.errors import MemoryLimitError

__all__ = ["cgroup_memory", "guard_optimizer_build", "training_state_bytes"]

_NO_LIMIT = 1 << 60  # cgroup v1 writes 2^63 rounded to pages for "no limit"


def cgroup_memory(proc_root: str = "/proc/self", cgroup_root: str = "/sys/fs/cgroup") -> Optional[dict]:
    """`{"limit", "in_use", "source"}` in bytes for this process's tightest cgroup memory limit, or None when
    no cgroup limits it. `in_use` leaves out the file cache, which the kernel reclaims before it kills."""
    best = None
    try:
        with open(os.path.join(proc_root, "cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2
            mounts = [cgroup_root, os.path.join(cgroup_root, "unified")]
            files = ("memory.max", "memory.current", "file")
        elif "memory" in controllers.split(","):
            mounts = [os.path.join(cgroup_root, "memory")]
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_cache")
        else:
            continue
        for mount in mounts:
            for directory in _self_and_ancestors(mount, path):
                found = _read_limit(directory, *files)
                if found and (best is None or found["limit"] - found["in_use"] < best["limit"] - best["in_use"]):
                    best = found
    return best


def _self_and_ancestors(mount: str, path: str) -> list[str]:
    parts = [p for p in path.split("/") if p]
    return [os.path.join(mount, *parts[:i]) for i in range(len(parts), -1, -1)]


def _read_limit(directory: str, limit_file: str, usage_file: str, cache_key: str) -> Optional[dict]:
    try:
        with open(os.path.join(directory, limit_file)) as f:
            text = f.read().strip()
        if text == "max" or int(text) >= _NO_LIMIT:
            return None
        with open(os.path.join(directory, usage_file)) as f:
            usage = int(f.read().strip())
    except (OSError, ValueError):
        return None
    cache = 0
    try:
        with open(os.path.join(directory, "memory.stat")) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == cache_key:
                    cache = int(value)
    except (OSError, ValueError):
        pass
    return {"limit": int(text), "in_use": max(usage - cache, 0), "source": os.path.join(directory, limit_file)}


def training_state_bytes(variables, slots_per_weight: int, *, replicas: int, stage: int = 0,
                         keep_whole_below: int = 0) -> dict:
    """The bytes training will add to this process once its optimizer is built, by kind (see the module's
    docstring): `slots`, `gradients`, `weights` (negative: what stage 3 frees) and `total`. Each variable
    counts once per copy this process holds of it (a mirrored variable's devices), at the copy's size."""
    copies = [_local_copy_bytes(v) for v in variables]
    whole = sum(sum(c) for c in copies)
    split_copies = [c for v, c in zip(variables, copies) if stage == 3 and math.prod(v.shape) >= keep_whole_below]
    split = sum(sum(c) for c in split_copies)
    largest = max((sum(c) for c in split_copies), default=0)  # gathered whole, on each local device
    gradients = {0: 3 * whole, 1: 3 * whole, 2: 2 * whole + whole / replicas}.get(
        stage, split / replicas + 3 * (whole - split) + 3 * largest)
    parts = {"slots": 2 * slots_per_weight * (whole / replicas if stage else whole),
             "gradients": gradients,
             "weights": split / replicas - split}
    return {**parts, "total": sum(parts.values())}


def _local_copy_bytes(variable) -> list[int]:
    """The bytes of each copy of the Keras `variable` this process holds: a distributed variable's components,
    or the variable itself."""
    import tensorflow as tf

    from tfdist._compat import backing_value

    backing = backing_value(variable)
    components = getattr(backing, "values", None) or (backing,)
    return [math.prod(c.shape) * tf.as_dtype(c.dtype).size for c in components]


def guard_optimizer_build(optimizer, *, replicas: int, stage: int = 0, keep_whole_below: int = 0) -> None:
    """Has `optimizer` check, when Keras builds it, that training fits in this process's cgroup memory limit,
    and raise `MemoryLimitError` instead of letting the kernel kill the process. `replicas`: the replicas in
    sync; `stage` and `keep_whole_below`: how the strategy splits the optimizer (`shard_optimizer`)."""
    if optimizer is None or cgroup_memory() is None or getattr(vars(optimizer).get("build"), "guarded", False):
        return
    build = optimizer.build

    def guarded(variables):
        if not optimizer.built:
            _check_fits(optimizer, variables, replicas=replicas, stage=stage, keep_whole_below=keep_whole_below)
        return build(variables)

    guarded.guarded = True
    optimizer.build = guarded


def _check_fits(optimizer, variables, **split) -> None:
    memory = cgroup_memory()
    if memory is None:
        return
    state = training_state_bytes(variables, _slots_per_weight(optimizer), **split)
    free = memory["limit"] - memory["in_use"]
    if state["total"] <= free:
        return
    how = f"shard_optimizer {split['stage']}" if split["stage"] else "an unsplit optimizer"
    raise MemoryLimitError(
        f"Training needs about {_gb(state['total'])} more memory in this process than it holds now "
        f"({_gb(state['slots'])} of optimizer slots and {_gb(state['gradients'])} of gradients, with {how}), "
        f"and its memory limit allows {_gb(free)} more ({_gb(memory['limit'])} in {memory['source']}, "
        f"{_gb(memory['in_use'])} in use). Split the weights and the state over the replicas "
        "(strategy.shard_optimizer: 3, or shard_optimizer=3), add processes, or raise the limit.")


def _slots_per_weight(optimizer) -> int:
    """How many slot variables the optimizer makes per trainable variable (Adam 2, SGD with momentum 1):
    counted on a copy built for one small variable."""
    import keras
    import numpy as np
    import tensorflow as tf

    inner = getattr(optimizer, "inner_optimizer", optimizer)
    with tf.init_scope():
        probe = type(inner).from_config(inner.get_config())
        probe.build([keras.Variable(np.zeros((3,), "float32"))])
    return sum(1 for v in probe.variables if tuple(v.shape) == (3,))


def _gb(nbytes: float) -> str:
    return f"{nbytes / 2 ** 30:.2f} GiB"
