"""`tfdist bench plan`: `tfdist plan`'s step times against the same jobs measured on namespace hosts.

    tfdist bench plan --links 100mbit,1gbit,10gbit --json results/plan.json

Runs `tfdist bench network`'s all-reduce jobs (multi-worker and Horovod, 2
hosts of one worker, the built-in model, 32 examples a worker; needs root),
then predicts each with the planner: the same config's model profiled, the
device rate taken from the bench's one-process step (`--measure`'s way), a
2-host cluster at the job's link rate. Per job: `ratio` = predicted step /
measured step (the issue's bounds are 0.85-1.15), and each term beside its
measurement, so a miss shows where it is: `compute_ms` against the one-process
step, `comm_ms` (the ring's bytes over the link) against the measured bytes
over the link, and `unmodelled_ms`, what the measured step holds beyond both
(collective set-up, the step's own overheads), which the planner does not
model.

Parameter servers are not compared yet: the bench puts both workers on one
host and the server on the other, a placement the planner's layouts do not
describe.
"""

from __future__ import annotations

import shlex
from typing import Any, Optional

from tfdist.errors import ConfigError

__all__ = ["KINDS", "compare", "measure"]

KINDS = ("multi_worker", "horovod")
BOUNDS = (0.85, 1.15)


def measure(*, repeats: int = 1, links: Optional[str] = None, kinds: Optional[str] = None) -> dict[str, Any]:
    from tfdist.bench import network

    chosen = [k.strip() for k in (kinds or ",".join(KINDS)).split(",") if k.strip()]
    if not chosen or any(kind not in KINDS for kind in chosen):
        raise ConfigError("kinds", f"must be among {', '.join(KINDS)} for the plan benchmark.", kinds)
    return compare(network.run(repeats=repeats, links=links, kinds=",".join(chosen)))


def compare(measured: dict[str, Any]) -> dict[str, Any]:
    """The planner's prediction beside each all-reduce job of a `tfdist bench network` result."""
    from tfdist.config import load_config
    from tfdist.launch.hosts import link_bits_per_second
    from tfdist.plan import Cluster, Layout, profile
    from tfdist.plan.predict import predict

    model = profile(load_config(None, _overrides(measured["jobs"]["compute_only"])))
    batch = measured["batch_per_worker"]
    rate = model.training_flops_per_example * batch / (measured["compute_only"]["step_time_ms"] / 1000)
    rows = []
    for kind in (k for k in KINDS if k in measured["table"]):
        for row in measured["table"][kind]:
            cluster = Cluster(devices=2, hosts=2, device_flops=rate, link=link_bits_per_second(row["link"]))
            step = predict(model, cluster, Layout(2), global_batch=2 * batch, micro_batches=1).step_ms
            rows.append({
                "kind": kind, "link": row["link"], "predicted_ms": step["total"], "measured_ms": row["step_time_ms"],
                "ratio": step["total"] / row["step_time_ms"],
                "compute_ms": {"predicted": step["compute"], "measured": row["compute_ms"]},
                "comm_ms": {"predicted": step["data_parallel"], "measured": row["comm_ms"]},
                "unmodelled_ms": row["step_time_ms"] - row["compute_ms"] - row["comm_ms"],
            })
    within = [BOUNDS[0] <= row["ratio"] <= BOUNDS[1] for row in rows]
    return {"benchmark": "plan", "bounds": BOUNDS, "gradient_bytes": measured["gradient_bytes"],
            "model_trainable_bytes": model.trainable_bytes, "device_flops": rate, "rows": rows,
            "network": {key: measured[key] for key in ("jobs", "table", "compute_only", "repeats")},
            "figures": {"within_bounds": sum(within), "jobs": len(rows),
                        **{f"ratio_{row['kind']}_{row['link']}": row["ratio"] for row in rows}}}


def _overrides(command: str) -> list[str]:
    """The `--set` values of a job's command line (as the network bench records it)."""
    words = shlex.split(command)
    return [value for flag, value in zip(words, words[1:]) if flag == "--set"]
