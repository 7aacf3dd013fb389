"""`tfdist bench plan_published`: `tfdist plan`'s scaling efficiency against published runs' figures.

    tfdist bench plan_published --json results/plan_published.json

For each run of `tfdist.plan.published.RUNS` (Horovod's Inception V3,
ResNet-101 and VGG-16 on 512 GPUs and on 128; Goyal et al.'s 256-GPU
ResNet-50): the model
profiled here, the paper's cluster as a preset, the predicted efficiency
beside the published one, the step's terms, and what each term would have to
be to meet the published figure. Nothing is timed: the result is the same on
every machine (`repeats` is not used).
"""

from __future__ import annotations

from typing import Any

__all__ = ["measure"]


def measure(*, repeats: int = 1) -> dict[str, Any]:
    from tfdist.plan.published import BOUND_POINTS, RUNS, compare

    del repeats  # a prediction, not a timing
    rows = [compare(run) for run in RUNS]
    return {"benchmark": "plan_published", "bound_points": BOUND_POINTS, "rows": rows,
            "figures": {"within_bound": sum(row["within_bound"] for row in rows), "runs": len(rows),
                        **{f"miss_points_{row['key']}": row["miss_points"] for row in rows}}}
