"""Machine-readable results and the human summary printed after training."""

from __future__ import annotations

import json
import math
import os
import tempfile
from typing import Any, Mapping

__all__ = ["format_summary", "megabytes", "write_json"]


def write_json(path: str, payload: Mapping[str, Any]) -> None:
    """Writes `payload` as JSON atomically: a crash leaves the old file or the new one."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(_plain(payload), f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _plain(value: Any) -> Any:
    """Numpy scalars and tuples to JSON types; NaN/inf to None (JSON has neither)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item"):  # numpy scalar
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def megabytes(size: float) -> str:
    """`1234567` -> `1.23 MB`; small sizes in bytes."""
    return f"{size / 1e6:.2f} MB" if size >= 10_000 else f"{size:,.0f} bytes"


def _short(device: str) -> str:
    """`/job:localhost/replica:0/task:0/device:CPU:0` -> `CPU:0` (single-host names)."""
    return device.split("device:")[-1] if device.startswith("/job:localhost") else device


def _groups(groups: list) -> str:
    """`[[a, b], [c, d]]` -> `2 of 2 devices: [a, b], [c, d]`."""
    listed = ", ".join(f"[{', '.join(_short(d) for d in group)}]" for group in groups)
    return f"{len(groups)} of {len(groups[0])} devices: {listed}"


def _optimizer_state(split: Mapping[str, Any]) -> str:
    fullest = max(split["slot_bytes_per_device"])
    text = (f"split over {split['devices']} devices (ZeRO stage {split['stage']}): {fullest:,} slot bytes on the "
            f"fullest, {fullest / split['unsplit_slot_bytes']:.2f} of a whole copy's {split['unsplit_slot_bytes']:,}")
    if "weight_bytes_per_device" in split:
        weights = max(split["weight_bytes_per_device"])
        text += (f"; {weights:,} weight bytes, {weights / split['unsplit_weight_bytes']:.2f} of "
                 f"{split['unsplit_weight_bytes']:,}")
    return text


def format_summary(result: Mapping[str, Any]) -> str:
    """A short block of text: strategy, devices, batch, throughput, final metrics."""
    replicas = result["num_replicas"]
    # A layout's replicas of one copy of the model compute on the same examples: the batch splits over the copies.
    per_replica = result["global_batch_size"] // max(result.get("layout", {}).get("model_copies", replicas), 1)
    lines = [
        "tfdist summary",
        f"  strategy        {result['strategy']} ({replicas} replica(s))",
        *([f"  cluster         {result['cluster']}"] if "cluster" in result else []),
        *([f"  layout          {result['layout']['text']}"] if "layout" in result else []),
        *([f"  elastic         {result['elastic']['resets']} reset(s), {result['elastic']['ranks']} rank(s) at the end"]
          if "elastic" in result else []),
        *([f"  sharded tables  {result['sharded_tables']}"] if "sharded_tables" in result else []),
        *([f"  tensor groups   {_groups(result['tensor_parallel_groups'])}"] if "tensor_parallel_groups" in result else []),
        *([f"  placement       {result['placement']}"] if "placement" in result else []),
        *([f"  optimizer state {_optimizer_state(result['optimizer_state'])}"] if "optimizer_state" in result else []),
        f"  local devices   {', '.join(_short(d) for d in result['devices'])}",
        f"  global batch    {result['global_batch_size']} ({per_replica} per replica"
        + (f", micro-batches of {result['micro_batch_size']})" if "micro_batch_size" in result else ")"),
        f"  precision       {result['precision']}",
        *([f"  input sharding  {result['input_sharding']}"] if "input_sharding" in result else []),
        "  samples/sec     "
        + (
            f"{result['samples_per_sec']:.1f} ({result['step_time_ms']:.2f} ms a step)"
            if result["samples_per_sec"]
            else "not measured (no steps after callbacks.throughput_warmup_steps)"
        ),
    ]
    if "host_cpu_busy" in result:
        lines.append(f"  host cores      {result['host_cpu_busy']:.0%} busy over those steps (every process on "
                     "this machine)")
    if "link_bytes_per_step" in result:
        link = result["link_bytes_per_step"]
        resent = result.get("link_retransmits_per_step") or 0.0
        resent_note = f", {resent:.1f} TCP segments sent again" if resent else ""
        lines.append(f"  link traffic    {megabytes(link['sent'])} sent, {megabytes(link['received'])} received "
                     f"a step (this host's link{resent_note})")
    if "input_stalls" in result:
        first, *rest = result["input_stalls"].removeprefix("input stalls: ").splitlines()
        lines += [f"  input stalls    {first}", *(f"{'':18}{line.strip()}" for line in rest)]
    for name, value in sorted(result["final"].items()):
        if name.startswith("val_"):
            lines.append(f"  {name:<15} {value:.4f}")
    return "\n".join(lines)
