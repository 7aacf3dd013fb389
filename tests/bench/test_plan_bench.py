"""`tfdist bench plan`: the planner's step times beside the network bench's measured jobs, term by term.
The jobs themselves are `tfdist bench network`'s, whose namespace-host run its own test checks."""

import json
import os

import pytest

from helpers import ROOT
from tfdist.bench.plan import compare, measure


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


def test_a_kind_the_planner_does_not_compare_is_refused_before_any_job_runs():
    from tfdist.errors import ConfigError

    with pytest.raises(ConfigError, match="`kinds` must be among multi_worker, horovod for the plan benchmark"):
        measure(kinds="parameter_server")
