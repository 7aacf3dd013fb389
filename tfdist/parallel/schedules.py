"""Pipeline schedules: the order in which each stage runs its micro-batch tasks.

A task is `("F", m)` (forward of micro-batch m) or `("B", m)` (its backward).
A schedule gives every stage its own task order; `PipelineStrategy` makes each
stage's device run its tasks in exactly that order (control dependencies), so
the schedule decides how many micro-batch activations a stage keeps alive.

- `gpipe` (Huang et al. 2018): all forwards, then all backwards. Every stage
  stashes all M micro-batches before its first backward.
- `1f1b` (PipeDream-Flush, Narayanan et al. 2021): stage k runs
  min(K - k - 1, M) warm-up forwards, then alternates one forward and one
  backward, then drains. A stage never holds more than min(K - k, M).

Example:

    >>> stage_orders("1f1b", num_stages=2, num_micro_batches=3)[0]
    [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('B', 2)]
    >>> peak_stash(stage_orders("gpipe", 2, 3)[0])
    3
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["SCHEDULES", "Task", "global_order", "peak_stash", "stage_orders"]

Task = tuple[str, int]
SCHEDULES = ("gpipe", "1f1b")


def stage_orders(schedule: str, num_stages: int, num_micro_batches: int) -> list[list[Task]]:
    """Each stage's task order under `schedule`.

    Raises:
      ValueError: unknown schedule or non-positive sizes.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"`schedule` must be one of {', '.join(SCHEDULES)}. Received: {schedule!r}")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in (num_stages, num_micro_batches)):
        raise ValueError(
            "`num_stages` and `num_micro_batches` must be whole numbers >= 1 (a pipeline's devices are its "
            f"`devices=`). Received: {num_stages!r}, {num_micro_batches!r}"
        )
    m_all = range(num_micro_batches)
    if schedule == "gpipe":
        return [[("F", m) for m in m_all] + [("B", m) for m in m_all] for _ in range(num_stages)]
    orders = []
    for stage in range(num_stages):
        warmup = min(num_stages - stage - 1, num_micro_batches)
        order: list[Task] = [("F", m) for m in range(warmup)]
        for i in range(num_micro_batches - warmup):
            order += [("F", warmup + i), ("B", i)]
        order += [("B", m) for m in range(num_micro_batches - warmup, num_micro_batches)]
        orders.append(order)
    return orders


def peak_stash(order: Iterable[Task]) -> int:
    """Most micro-batches whose forward ran and whose backward has not."""
    live = peak = 0
    for kind, _ in order:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def global_order(orders: list[list[Task]]) -> list[tuple[int, Task]]:
    """One sequence of (stage, task) that respects data and per-stage order.

    F(k, m) needs F(k-1, m); B(k, m) needs F(k, m) and B(k+1, m). Graph
    building follows this sequence, so every task's inputs exist when it is
    built.

    Raises:
      ValueError: the orders deadlock (a task waits on one that waits on it).
    """
    num_stages = len(orders)
    done: set[tuple[int, Task]] = set()
    position = [0] * num_stages
    sequence = []
    total = sum(len(o) for o in orders)
    while len(sequence) < total:
        progressed = False
        for stage in range(num_stages):
            if position[stage] == len(orders[stage]):
                continue
            kind, m = orders[stage][position[stage]]
            if kind == "F":
                ready = stage == 0 or (stage - 1, ("F", m)) in done
            else:
                ready = (stage, ("F", m)) in done and (
                    stage == num_stages - 1 or (stage + 1, ("B", m)) in done
                )
            if ready:
                done.add((stage, (kind, m)))
                sequence.append((stage, (kind, m)))
                position[stage] += 1
                progressed = True
        if not progressed:
            raise ValueError(f"pipeline schedule deadlocks: {orders}")
    return sequence
