"""`tfdist bench plan`: the planner's step times beside the network bench's measured jobs, term by term."""

import json
import os

import pytest

from helpers import ROOT
from tfdist.bench.plan import compare, measure

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="namespace hosts need root")


def test_each_predicted_term_stands_beside_its_measurement():
    """On the committed network run (3 links, 2 kinds): the ring's bytes over the link predict the
    measured bytes' time, and what the planner leaves out is what the measured step holds beyond."""
    with open(os.path.join(ROOT, "results", "network.json")) as f:
        measured = json.load(f)
    result = compare(measured)
    assert result["model_trainable_bytes"] == measured["gradient_bytes"]  # the same model, profiled again
    assert [(row["kind"], row["link"]) for row in result["rows"]] == [
        (kind, link) for kind in ("multi_worker", "horovod") for link in ("100mbit", "1gbit", "10gbit")]
    for row in result["rows"]:
        assert row["ratio"] == pytest.approx(row["predicted_ms"] / row["measured_ms"])
        # The device rate comes from the one-process step (as --measure takes it): compute agrees by
        # construction; the bytes are the planner's own, and agree with the link's counters to 10%.
        assert row["compute_ms"]["predicted"] == pytest.approx(row["compute_ms"]["measured"])
        assert row["comm_ms"]["predicted"] == pytest.approx(row["comm_ms"]["measured"], rel=0.1), row
        assert row["unmodelled_ms"] == pytest.approx(
            row["measured_ms"] - row["compute_ms"]["measured"] - row["comm_ms"]["measured"])
    assert result["figures"]["jobs"] == 6


@needs_root
@pytest.mark.xdist_group("namespace_hosts")  # with tests/launch/test_hosts.py, which checks that no host is left
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_run_plans_the_jobs_it_measured():
    result = measure(links="1gbit", kinds="multi_worker", repeats=1)
    (row,) = result["rows"]
    assert row["kind"] == "multi_worker" and row["link"] == "1gbit" and row["measured_ms"] > 0
    assert row["comm_ms"]["predicted"] == pytest.approx(row["comm_ms"]["measured"], rel=0.15), row
    assert result["network"]["table"]["multi_worker"][0]["step_time_ms"] == row["measured_ms"]
