"""`tfdist plan` against published scaling runs (Horovod's 512 and 128 GPUs, Goyal et al.'s 256): the planner's
efficiency from the hardware each paper states, within 10 points where docs/planning.md says it is, and the
page's figures the ones the planner gives now."""

import json
import os

import pytest

from helpers import ROOT
from tfdist.plan.published import BOUND_POINTS, RUNS, compare


@pytest.fixture(scope="module")
def rows():
    return {row["key"]: row for row in map(compare, RUNS)}


def test_the_predicted_efficiencies_are_within_10_points_but_vgg16s_on_512_gpus(rows):
    assert set(rows) == {"InceptionV3_512", "ResNet101_512", "VGG16_512", "InceptionV3_128", "ResNet101_128",
                         "VGG16_128", "ResNet50_256"}
    for key, row in rows.items():
        assert (abs(row["miss_points"]) <= BOUND_POINTS) == (key != "VGG16_512"), row
    # Horovod's VGG-16 on 128 GPUs (79%) is predicted within 3 points; on 512 (68%) it misses by 13. The
    # planner's compute and ring bytes a GPU are the same at both scales, so it predicts nearly the same
    # efficiency at both: what the published drop of 11 points holds is a cost growing with the ring's length.
    small, large = rows["VGG16_128"], rows["VGG16_512"]
    assert abs(small["miss_points"]) < 3 and large["miss_points"] > BOUND_POINTS
    assert small["step_ms"]["compute"] == large["step_ms"]["compute"]
    assert large["step_ms"]["data_parallel"] == pytest.approx(small["step_ms"]["data_parallel"], rel=0.01)
    assert abs(small["predicted"] - large["predicted"]) < 0.005
    # Meeting 68% on 512 takes twice the all-reduce the ring's bytes take there.
    assert large["to_meet_published"]["comm_ms"] == pytest.approx(2 * large["step_ms"]["data_parallel"], rel=0.05)
    # Goyal et al. estimate ResNet-50's backward pass on one P100 at about 120 ms.
    assert rows["ResNet50_256"]["backward_ms"] == pytest.approx(120, rel=0.1)


def test_the_planning_page_and_the_committed_json_hold_the_figures_the_planner_gives(rows):
    with open(os.path.join(ROOT, "results", "plan_published.json")) as f:
        committed = {row["key"]: row for row in json.load(f)["rows"]}
    with open(os.path.join(ROOT, "docs", "planning.md")) as f:
        page = f.read()
    for key, row in rows.items():
        assert committed[key]["predicted"] == pytest.approx(row["predicted"], abs=1e-4), key
        assert f"| {100 * row['published']:.0f}% | {100 * row['predicted']:.1f}% |" in page, key
