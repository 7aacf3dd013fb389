"""`tfdist bench plan`: the planner's step times beside the network bench's measured jobs, term by term.
The jobs themselves are `tfdist bench network`'s, whose namespace-host run its own test checks."""

import json
import os

import pytest

from helpers import ROOT, measure_in_fresh_process
from benchmarks.plan import _predicted, _profiled, compare, measure
from tfdist.launch.hosts import link_bits_per_second


def test_each_predicted_term_stands_beside_its_measurement():
    """On the committed network run (3 links, 3 kinds): the ring's bytes (or a parameter-server
    worker's reads) over the link predict the measured bytes' time, and what the planner leaves out is
    what the measured step holds beyond the prediction."""
    with open(os.path.join(ROOT, "results", "network.json")) as f:
        measured = json.load(f)
    result = compare(measured)
    assert result["model_trainable_bytes"] == measured["gradient_bytes"]  # the same model, profiled again
    assert [(row["kind"], row["link"]) for row in result["rows"]] == [
        (kind, link) for kind in ("multi_worker", "horovod", "parameter_server")
        for link in ("100mbit", "1gbit", "10gbit")]
    for row in result["rows"]:
        assert row["ratio"] == pytest.approx(row["predicted_ms"] / row["measured_ms"])
        # The device rate comes from the one-process step (as --measure takes it): compute agrees by
        # construction; the bytes are the planner's own, and agree with the link's counters to 10%.
        assert row["compute_ms"]["predicted"] == pytest.approx(row["compute_ms"]["measured"])
        assert row["comm_ms"]["predicted"] == pytest.approx(row["comm_ms"]["measured"], rel=0.1), row
        assert row["unmodelled_ms"] == pytest.approx(row["measured_ms"] - row["predicted_ms"])
    assert result["figures"]["jobs"] == 9
    # Every launch's step time is kept beside the medians, and compares again unchanged.
    launches = result["network"]["step_ms_by_launch"]
    assert launches["horovod@1gbit"] == [launch["step_time_ms"] for launch in measured["samples"]["horovod@1gbit"]]
    assert len(launches["compute_only"]) == measured["repeats"]
    assert compare(result["network"])["network"]["step_ms_by_launch"] == launches


def test_the_probes_latency_variable_cost_and_host_rate_are_what_their_steps_hold_beyond_the_prediction():
    """The committed plan run compared again: each job's prediction with the latency probe's per-step
    cost is the prediction without it plus that cost; the parameter servers' cost splits into a fixed
    part and each variable's, which predict the variables probe's step; the host rate found makes the
    planner predict the bytes probe's step, and never makes a job faster; the figures are the
    committed ones."""
    with open(os.path.join(ROOT, "results", "plan.json")) as f:
        committed = json.load(f)
    result = compare(committed["network"], committed["probe"], committed["bytes_probe"], committed["variable_probe"])
    for row, before in zip(result["rows"], committed["rows"]):
        latency = row["with_probe_latency"]["link_latency_ms"]
        assert latency >= 0 and row["with_probe_latency"]["ratio"] == pytest.approx(
            before["with_probe_latency"]["ratio"])
        if row["kind"] != "parameter_server":  # the latency adds to the ring's time on the wire
            assert row["with_probe_latency"]["predicted_ms"] == pytest.approx(row["predicted_ms"] + latency)
        probe = next(r for r in committed["probe"]["table"][row["kind"]] if r["link"] == row["link"])
        assert latency <= (2 if row["kind"] == "parameter_server" else 1) * probe["step_time_ms"]
        both = row["with_probes"]
        assert both["ratio"] == pytest.approx(before["with_probes"]["ratio"])
        if row["kind"] == "parameter_server":  # the latency probe's cost: a fixed part and its 4 variables'
            assert both["link_latency_ms"] + 4 * both["variable_latency_ms"] == pytest.approx(latency)
        else:
            assert both["link_latency_ms"] == latency and "variable_latency_ms" not in both
        assert both["predicted_ms"] >= row["with_probe_latency"]["predicted_ms"] * (1 - 1e-9)
    # The fixed part and the cost of each of its 18 variables predict the variables probe's own step.
    many, many_rate = _profiled(committed["variable_probe"])
    assert many.trainable_variables == 18
    for measured in committed["variable_probe"]["table"]["parameter_server"]:
        both = next(row["with_probes"] for row in result["rows"]
                    if row["kind"] == "parameter_server" and row["link"] == measured["link"])
        assert both["variable_latency_ms"] == result["variable_latency_ms"][measured["link"]] > 0
        predicted, _, _ = _predicted(many, many_rate, committed["network"]["batch_per_worker"], "parameter_server",
                                     link_bits_per_second(measured["link"]), both["link_latency_ms"] / 1000, 0.0,
                                     both["variable_latency_ms"] / 1000)
        assert predicted == pytest.approx(measured["step_time_ms"], rel=1e-3)  # its few bytes barely share the link
    # This run's bytes probe ran at 10 Gbit/s only: every link's jobs take the rate found there.
    assert {kind: list(by_link) for kind, by_link in result["host_rates"].items()} == {
        kind: ["10gbit"] for kind in ("multi_worker", "horovod", "parameter_server")}
    for kind, by_link in result["host_rates"].items():
        found = by_link["10gbit"]
        if found["bytes_per_sec"]:  # a transport slower than the link: the probe's step as measured
            assert found["probe_predicted_ms"] == pytest.approx(found["probe_measured_ms"], rel=1e-6), kind
        else:
            assert found["probe_predicted_ms"] >= found["probe_measured_ms"]
    assert all(row["with_probes"]["host_rate_link"] == "10gbit" for row in result["rows"])
    for name in ("within_bounds_with_probe_latency", "within_bounds_with_probes"):
        assert result["figures"][name] == committed["figures"][name]


@pytest.mark.parametrize("name", ["plan_per_link.json", "plan_per_link_xeon.json"])
def test_each_link_takes_the_host_rate_its_own_bytes_probe_found(name):
    """The committed runs whose bytes probe ran at every link (on two machines), compared again: each
    job takes the rate found at its own link, that rate makes the planner predict the probe's step
    there, and the figures are the committed ones."""
    with open(os.path.join(ROOT, "results", name)) as f:
        committed = json.load(f)
    result = compare(committed["network"], committed["probe"], committed["bytes_probe"], committed["variable_probe"])
    links = ["100mbit", "1gbit", "10gbit"]
    assert {kind: sorted(by_link, key=links.index) for kind, by_link in result["host_rates"].items()} == {
        kind: links for kind in ("multi_worker", "horovod", "parameter_server")}
    for row in result["rows"]:
        assert row["with_probes"]["host_rate_link"] == row["link"]
        found = result["host_rates"][row["kind"]][row["link"]]
        assert row["with_probes"]["host_rate_bytes_per_sec"] == found["bytes_per_sec"]
        if found["bytes_per_sec"]:
            assert found["probe_predicted_ms"] == pytest.approx(found["probe_measured_ms"], rel=1e-6)
        else:  # the link alone predicts the probe's step (the parameter servers at 100 Mbit/s)
            assert found["probe_predicted_ms"] >= found["probe_measured_ms"]
    if name == "plan_per_link.json":  # on the AVX2 machine every transport was slower at 1 Gbit/s than at 10
        for kind, by_link in result["host_rates"].items():
            assert by_link["1gbit"]["bytes_per_sec"] < by_link["10gbit"]["bytes_per_sec"], kind
    assert result["figures"] == pytest.approx(committed["figures"])


def test_the_pipeline_in_one_process_is_predicted_from_its_own_stages_times():
    """The shipped pipeline config on 2 logical devices, beside what `tfdist plan --measure` times: the
    prediction is the job's own stages timed on their micro-batches, no shorter than their CPU time over
    the machine's cores, and what the one-device step does besides its forward and backward."""
    result = measure_in_fresh_process("benchmarks.plan", 'dict(kinds="pipeline", repeats=1)')
    assert [(row["kind"], row["batch"]) for row in result["rows"]] == [("pipeline", 64), ("pipeline", 256)]
    for row in result["rows"]:
        terms, timed = row["terms_ms"], row["timed"]
        assert row["layout"] == "data 1 x pipeline 2" and terms["total"] == pytest.approx(row["predicted_ms"])
        assert len(row["stages"]) == 2 and sum(map(len, row["stages"])) == 8  # the job's cut of the digits CNN
        key = f"2 stages, micro-batch {row['batch'] // 4}"
        stages, cpu = timed["stage_ms"][key], timed["stage_cpu_ms"][key]
        schedule = 4 * max(stages) + min(stages)  # M = 4; the 2 devices share the machine's cores
        cores = len(os.sched_getaffinity(0))
        assert terms["compute"] + terms["bubble"] == pytest.approx(max(schedule, 4 * sum(cpu) / cores))
        assert terms["step_rest"] == pytest.approx(timed["rest_ms"])
        assert row["ratio"] == pytest.approx(row["predicted_ms"] / row["measured_ms"])
        assert row["unmodelled_ms"] == pytest.approx(row["measured_ms"] - row["predicted_ms"])


@pytest.mark.parametrize("kinds, links, message", [
    ("sparse", None, "`kinds` must be among multi_worker, horovod, parameter_server, pipeline, tensor_parallel"),
    ("horovod,pipeline", None, "mixes kinds on namespace hosts and in one process"),
    ("tensor_parallel", "1gbit", "`links` only applies to the network kinds"),
])
def test_a_kind_the_planner_does_not_compare_is_refused_before_any_job_runs(kinds, links, message):
    from tfdist.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        measure(kinds=kinds, links=links)
