"""`tfdist plan` against published scaling runs (Horovod's 512 GPUs, Goyal et al.'s 256): the planner's
efficiency from the hardware each paper states, within 10 points where the README says it is, and the
README's figures the ones the planner gives now."""

import json
import os

import pytest

from helpers import ROOT
from tfdist.plan.published import BOUND_POINTS, RUNS, compare


@pytest.fixture(scope="module")
def rows():
    return {run.model: compare(run) for run in RUNS}


def test_the_predicted_efficiencies_are_within_10_points_but_vgg16s_whose_compute_term_misses(rows):
    for model in ("InceptionV3", "ResNet101", "ResNet50"):
        assert abs(rows[model]["miss_points"]) <= BOUND_POINTS, rows[model]
    vgg = rows["VGG16"]
    # VGG-16 is predicted to scale better than it did. Its all-reduce (553 MB over 25 Gbit/s) is the
    # planner's own bytes; meeting 68% takes either twice that exposed, or half the compute a step.
    assert vgg["miss_points"] > BOUND_POINTS
    assert vgg["to_meet_published"]["compute_ms"] == pytest.approx(vgg["step_ms"]["compute"] / 2, rel=0.05)
    assert vgg["to_meet_published"]["comm_ms"] == pytest.approx(2 * vgg["step_ms"]["data_parallel"], rel=0.05)
    # Goyal et al. estimate ResNet-50's backward pass on one P100 at about 120 ms.
    assert rows["ResNet50"]["backward_ms"] == pytest.approx(120, rel=0.1)


def test_the_readme_and_the_committed_json_hold_the_figures_the_planner_gives(rows):
    with open(os.path.join(ROOT, "results", "plan_published.json")) as f:
        committed = {row["model"]: row for row in json.load(f)["rows"]}
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    for model, row in rows.items():
        assert committed[model]["predicted"] == pytest.approx(row["predicted"], abs=1e-4), model
        assert f"| {100 * row['published']:.0f}% | {100 * row['predicted']:.1f}% |" in readme, model
