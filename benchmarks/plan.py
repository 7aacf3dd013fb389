"""`tfdist bench plan`: `tfdist plan`'s step times against the same jobs measured on namespace hosts,
or in one process.

    tfdist bench plan --links 100mbit,1gbit,10gbit --json results/plan.json

Runs `tfdist bench network`'s jobs on 2 namespace hosts (needs root; the
built-in model, 32 examples a worker): multi-worker and Horovod (a worker a
host) and parameter servers (both workers on one host, the server on the
other: the planner's `servers_apart`), then predicts each with the planner:
the same config's model profiled, the device rate taken from the bench's
one-process step (`--measure`'s way), the cluster at the job's link rate.
Per job: `ratio` = predicted step / measured step (the issue's bounds are
0.85-1.15; a parameter-server job's step is a worker step over its 2
workers, as the bench times it), and each term beside its measurement, so a
miss shows where it is: `compute_ms` against the one-process step, `comm_ms`
(the ring's bytes, or a worker step's reads, over the link) against the
measured bytes over the link, and `unmodelled_ms`, what the measured step
holds beyond the prediction (collective set-up, the step's own overheads).
A latency probe then launches each kind again at each link with a model of
85 weights (`PROBE_MODEL`): its measured step over the planner's prediction
of it is the per-step cost across hosts, and each job is predicted again
with it as the cluster's `link_latency` (`with_probe_latency`), as a user who
knows that cost gives `tfdist plan --link_latency`. A bytes probe then
launches each kind at each link with a model of 2.5 MB of gradients and
little compute (`HOST_RATE_PROBE`): what its step takes beyond the
prediction with the latency probe's cost is the hosts' transport (gRPC, or
Horovod's Gloo over TCP) serializing and copying its bytes on the cores the
workers also compute on, and, on a link slower than the cores, handing them
to the link a few packets at a time as its rate allows; the rate that makes
the planner predict its step is the cluster's `host_rate` at that link, and
each job is predicted a third time with both (`with_probes`), as
`tfdist plan --link_latency --host_rate` would.
For the parameter servers a variables probe (`VARIABLE_PROBE`: the latency
probe with 18 variables instead of 4) launches at each link too: what its
step holds beyond the latency probe's, over the 14 variables more, is what
each variable costs a worker step (its read and its update are RPCs of
their own), `variable_latency`; the latency probe's cost less its own 4
variables' is then the fixed part, and `with_probes` counts both
(`--variable_latency`).

The jobs and the probes run in the same alternated rounds (each round
launches every one of them once, `network.measure_together`), so that a
probe's cost is measured on the machine as the jobs it is added to found it,
not minutes apart.

`--kinds pipeline,tensor_parallel` runs in one process instead (no root):
the shipped configs' jobs (configs/pipeline.yaml as one replica of 2 stages,
configs/tensor_parallel.yaml), each on 2 logical CPU devices of one core
each (intra-op 1, inter-op 2), at the config's batch and at 256, timed in
alternated rounds beside the one-device step `tfdist plan --measure` times
(the same job on one device, a device's share of the batch). Per job: the
prediction at that measured rate beside the measured step, each predicted
term, and `unmodelled_ms`, what the measured step holds beyond the
prediction.
"""

from __future__ import annotations

import shlex
from typing import Any, Optional

from tfdist.errors import ConfigError

__all__ = ["KINDS", "compare", "measure"]

NETWORK_KINDS = ("multi_worker", "horovod", "parameter_server")
ONE_PROCESS_KINDS = ("pipeline", "tensor_parallel")
KINDS = NETWORK_KINDS + ONE_PROCESS_KINDS
BOUNDS = (0.85, 1.15)
# kind: the shipped config, and what makes it one layout on 2 logical devices
ONE_PROCESS_JOBS = {"pipeline": ("configs/pipeline.yaml", ["strategy.logical_devices=2"]),
                    "tensor_parallel": ("configs/tensor_parallel.yaml", [])}
ONE_PROCESS_BATCHES = (None, 256)  # the config's, and a larger one
THREADS = ["runtime.intra_op_threads=1", "runtime.inter_op_threads=2"]  # a core for each logical device
STEPS_PER_ROUND = 10
# The latency probe: digits through one hidden unit (85 weights, next to no compute), launched as each
# network job is; what its step takes beyond the planner's prediction is the step's cost across hosts.
PROBE_MODEL = ["model.name=mlp", "model.width=1", "model.depth=1"]
# The bytes probe: digits through 8192 hidden units (2.5 MB of gradients, 4 ms of compute on a core), at every
# link: what the hosts' transport costs a byte beyond the link's own time depends on the link's pace.
HOST_RATE_PROBE = ["model.name=mlp", "model.width=8192", "model.depth=1"]
# The variables probe: the latency probe with 8 hidden layers (18 variables, not 4), parameter servers only,
# where each variable is read and updated by an RPC of its own: the steps' difference over the variables'.
VARIABLE_PROBE = [*PROBE_MODEL, "model.depth=8"]


def measure(*, repeats: int = 1, links: Optional[str] = None, kinds: Optional[str] = None) -> dict[str, Any]:
    """The network kinds (default) on namespace hosts, or the one-process kinds, as `kinds` chooses
    (not both at once: one needs root and takes minutes, the other neither)."""
    chosen = [k.strip() for k in (kinds or ",".join(NETWORK_KINDS)).split(",") if k.strip()]
    if not chosen or any(kind not in KINDS for kind in chosen):
        raise ConfigError("kinds", f"must be among {', '.join(KINDS)} for the plan benchmark.", kinds)
    if set(chosen) <= set(ONE_PROCESS_KINDS):
        if links:
            raise ConfigError("links", f"only applies to the network kinds ({', '.join(NETWORK_KINDS)}).", links)
        return in_one_process(chosen, repeats=repeats)
    if not set(chosen) <= set(NETWORK_KINDS):
        raise ConfigError("kinds", "mixes kinds on namespace hosts and in one process: run them apart.", kinds)
    from tfdist.bench import network

    ran = network.listed_links(links)
    settings = {"jobs": {"links": ran, "kinds": chosen},
                "probe": {"links": ran, "kinds": chosen, "extra": PROBE_MODEL},
                "bytes_probe": {"links": ran, "kinds": chosen, "extra": HOST_RATE_PROBE}}
    if "parameter_server" in chosen:
        settings["variable_probe"] = {"links": ran, "kinds": ["parameter_server"], "extra": VARIABLE_PROBE}
    # The jobs and their probes in the same rounds: a probe's cost is taken from the machine the jobs ran on.
    measured = network.measure_together({name: {**setting, "variants": False} for name, setting in settings.items()},
                                        repeats=repeats)
    return compare(measured["jobs"], measured["probe"], measured["bytes_probe"], measured.get("variable_probe"))


def in_one_process(kinds, *, repeats: int) -> dict[str, Any]:
    """Each kind's shipped job at each batch, timed beside what `tfdist plan --measure` times (its
    one-device step and forward and backward, in the same alternated rounds; a pipeline's stages
    after), and predicted from those times (call before TensorFlow has started: it fixes the threads)."""
    import itertools
    import os

    from tfdist import training
    from tfdist.bench.jobs import ROOT
    from tfdist.callbacks.throughput import fit_round
    from tfdist.config import load_config
    from tfdist.plan import Cluster, Layout, MeasuredTimes, one_device_config, profile, shared_cores
    from tfdist.plan.predict import predict
    from tfdist.strategies.devices import configure_runtime

    rows = []
    for kind in kinds:
        path, overrides = ONE_PROCESS_JOBS[kind]
        model = None  # profiled once a kind: the batch does not change it
        for batch in ONE_PROCESS_BATCHES:
            sized = [f"train.global_batch_size={batch}"] if batch else []
            config = load_config(os.path.join(ROOT, path), [*overrides, *sized, *THREADS])
            configure_runtime(config)
            devices = config.strategy.logical_devices
            batch = config.train.global_batch_size
            job = training.prepare(config)
            job_round = fit_round(job.model, job.train_data, batch=batch, steps=STEPS_PER_ROUND)
            job_round()  # a pipeline cuts its model at its first step, by its layers' noisy times: time that cut
            partition = job.strategy.partition_of(job.model) if kind == "pipeline" else None
            starts = itertools.accumulate(len(stage.operations) for stage in partition.stages[:-1]) if partition else ()
            model = model or profile(config)
            measured = MeasuredTimes(one_device_config(config, batch // devices), model, rounds=repeats,
                                     other_rounds={kind: job_round}, starts=list(starts))
            layout = Layout(1, stages=config.pipeline.num_stages) if kind == "pipeline" else \
                Layout(1, tensor_parallel=config.strategy.tensor_parallel_size or devices)
            cluster = Cluster(devices=devices, device_flops=measured.device_flops, host_cores=shared_cores())
            predicted = predict(model, cluster, layout,
                                global_batch=batch, micro_batches=config.pipeline.num_micro_batches,
                                schedule=config.pipeline.schedule.value, balance_by=config.pipeline.balance_by.value,
                                measured=measured).step_ms
            measured_ms = measured.other_ms[kind]
            rows.append({"kind": kind, "config": path, "batch": batch, "layout": layout.name,
                         "stages": [stage.layer_names for stage in partition.stages] if partition else None,
                         "one_device_ms": measured.step_ms, "measured_ms": measured_ms, "timed": measured.to_dict(),
                         "predicted_ms": predicted["total"], "ratio": predicted["total"] / measured_ms,
                         "terms_ms": predicted, "unmodelled_ms": measured_ms - predicted["total"]})
    return {"benchmark": "plan", "bounds": BOUNDS, "threads": THREADS, "rows": rows,
            "figures": {"within_bounds": sum(BOUNDS[0] <= row["ratio"] <= BOUNDS[1] for row in rows),
                        "jobs": len(rows), **{f"ratio_{row['kind']}_batch{row['batch']}": row["ratio"]
                                              for row in rows}}}


def compare(measured: dict[str, Any], probe: Optional[dict[str, Any]] = None,
            bytes_probe: Optional[dict[str, Any]] = None,
            variable_probe: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The planner's prediction beside each job of a `tfdist bench network` result. With `probe` (the
    same launches of `PROBE_MODEL`), each is predicted again with the per-step cost across hosts the
    probe shows (`link_latency`: the probe's measured step over the planner's own prediction of it);
    with `bytes_probe` too (`HOST_RATE_PROBE`), a third time with the `host_rate` at which the planner
    predicts the bytes probe's step at the job's link; with `variable_probe` (`VARIABLE_PROBE`), the
    parameter servers' per-step cost is split into a fixed part and `variable_latency` for each variable,
    from the two probes' costs at each link."""
    from tfdist.launch.hosts import link_bits_per_second

    model, rate = _profiled(measured)
    batch = measured["batch_per_worker"]
    latency, host_rates = {}, {}
    per_variable: dict[tuple[str, str], float] = {}  # (kind, link): seconds a variable adds to a worker step
    if probe:
        probe_model, probe_rate = _profiled(probe)
        latency = _probe_costs(probe, probe_model, probe_rate, batch)
    fixed = dict(latency)  # the per-step cost less what the probe's variables cost, where that is known
    if probe and variable_probe:
        many_model, many_rate = _profiled(variable_probe)
        added = many_model.trainable_variables - probe_model.trainable_variables
        for (kind, link), seconds in _probe_costs(variable_probe, many_model, many_rate, batch).items():
            per_variable[kind, link] = max(0.0, (seconds - latency[kind, link]) / added)
            fixed[kind, link] = max(0.0, latency[kind, link]
                                    - probe_model.trainable_variables * per_variable[kind, link])
    if probe and bytes_probe:
        wide_model, wide_rate = _profiled(bytes_probe)
        for kind in (k for k in NETWORK_KINDS if k in bytes_probe["table"]):
            for row in bytes_probe["table"][kind]:
                link, seconds = link_bits_per_second(row["link"]), fixed[kind, row["link"]]
                variables = per_variable.get((kind, row["link"]), 0.0)

                def probe_ms(rate_, kind=kind, link=link, seconds=seconds, variables=variables):
                    return _predicted(wide_model, wide_rate, batch, kind, link, seconds, rate_, variables)[0]

                found = _host_rate(probe_ms, row["step_time_ms"])
                host_rates[kind, row["link"]] = {"bytes_per_sec": found, "link": row["link"],
                                                 "probe_measured_ms": row["step_time_ms"],
                                                 "probe_predicted_ms": probe_ms(found)}
    rows = []
    for kind in (k for k in NETWORK_KINDS if k in measured["table"]):
        for row in measured["table"][kind]:
            link = link_bits_per_second(row["link"])
            predicted, comm, step = _predicted(model, rate, batch, kind, link, 0.0)
            rows.append({
                "kind": kind, "link": row["link"], "predicted_ms": predicted, "measured_ms": row["step_time_ms"],
                "ratio": predicted / row["step_time_ms"], "terms_ms": step,
                "compute_ms": {"predicted": step["compute"], "measured": row["compute_ms"]},
                "comm_ms": {"predicted": comm, "measured": row["comm_ms"]},
                "unmodelled_ms": row["step_time_ms"] - predicted,
            })
            if (kind, row["link"]) in latency:
                seconds = latency[kind, row["link"]]
                with_latency, _, _ = _predicted(model, rate, batch, kind, link, seconds)
                rows[-1]["with_probe_latency"] = {"link_latency_ms": 1000 * seconds, "predicted_ms": with_latency,
                                                  "ratio": with_latency / row["step_time_ms"]}
            found = _host_rate_for(host_rates, kind, row["link"])
            if found:
                variables = per_variable.get((kind, row["link"]), 0.0)
                with_both, _, _ = _predicted(model, rate, batch, kind, link, fixed[kind, row["link"]],
                                             found["bytes_per_sec"], variables)
                rows[-1]["with_probes"] = {"link_latency_ms": 1000 * fixed[kind, row["link"]],
                                           "host_rate_bytes_per_sec": found["bytes_per_sec"],
                                           "host_rate_link": found["link"], "predicted_ms": with_both,
                                           "ratio": with_both / row["step_time_ms"]}
                if variables:
                    rows[-1]["with_probes"]["variable_latency_ms"] = 1000 * variables
    # Each prediction's ratios by job: as a user runs it, then with each probe's figures.
    ratios = {"": {f"{row['kind']}_{row['link']}": row["ratio"] for row in rows}}
    for key in ("with_probe_latency", "with_probes"):
        if rows and all(key in row for row in rows):
            ratios[f"_{key}"] = {f"{row['kind']}_{row['link']}": row[key]["ratio"] for row in rows}
    figures = {"jobs": len(rows)}
    for suffix, by_job in ratios.items():
        figures[f"within_bounds{suffix}"] = sum(BOUNDS[0] <= ratio <= BOUNDS[1] for ratio in by_job.values())
        figures.update({f"ratio{suffix}_{job}": ratio for job, ratio in by_job.items()})
    figures.update({f"host_rate_MBps_{kind}_{link}": found["bytes_per_sec"] / 1e6
                    for (kind, link), found in host_rates.items()})
    result = {"benchmark": "plan", "bounds": BOUNDS, "gradient_bytes": measured["gradient_bytes"],
              "model_trainable_bytes": model.trainable_bytes, "device_flops": rate, "rows": rows,
              "network": _kept(measured), "figures": figures}
    if probe:
        result["probe"] = _kept(probe)
    if host_rates:
        result["host_rates"] = {}  # kind: link: what the bytes probe found there
        for (kind, link), found in host_rates.items():
            result["host_rates"].setdefault(kind, {})[link] = found
        result["bytes_probe"] = _kept(bytes_probe)
    if per_variable:
        result["variable_latency_ms"] = {link: 1000 * seconds for (_, link), seconds in per_variable.items()}
        result["variable_probe"] = _kept(variable_probe)
    return result


def _host_rate_for(host_rates: dict[tuple[str, str], dict], kind: str, link: str) -> Optional[dict[str, Any]]:
    """The host rate the bytes probe found for `kind` at `link`; where it did not run there (a result from
    before it ran at every link), the one at the fastest link it ran at; None without one."""
    from tfdist.launch.hosts import link_bits_per_second

    ran_at = [at for k, at in host_rates if k == kind]
    if not ran_at:
        return None
    return host_rates[kind, link if link in ran_at else max(ran_at, key=link_bits_per_second)]


def _host_rate(predicted_ms, measured_ms: float) -> float:
    """The bytes/s at which `predicted_ms(host_rate)` is `measured_ms` (0: the link alone predicts at
    least that), found by halving the interval of rates in log space."""
    if predicted_ms(0.0) >= measured_ms:
        return 0.0
    low, high = 1e3, 1e13  # bytes/s
    for _ in range(80):
        middle = (low * high) ** 0.5
        low, high = (middle, high) if predicted_ms(middle) > measured_ms else (low, middle)
    return (low * high) ** 0.5


# What a result keeps of the network runs it compares: enough to compare them again (`compare`).
_KEPT = ("jobs", "table", "compute_only", "repeats", "batch_per_worker", "gradient_bytes")


def _kept(run: dict[str, Any]) -> dict[str, Any]:
    """`_KEPT` of a network run, and each job's step time in every launch (the medians' spread)."""
    kept = {key: run[key] for key in _KEPT}
    if "samples" in run:
        kept["step_ms_by_launch"] = {job: [launch["step_time_ms"] for launch in launches]
                                     for job, launches in run["samples"].items()}
    elif "step_ms_by_launch" in run:  # a committed result compared again
        kept["step_ms_by_launch"] = run["step_ms_by_launch"]
    return kept


def _profiled(measured: dict[str, Any]):
    """The profile of a network result's model, and the device rate its one-process step gives."""
    from tfdist.config import load_config
    from tfdist.plan import profile

    model = profile(load_config(None, _overrides(measured["jobs"]["compute_only"])))
    step_s = measured["compute_only"]["step_time_ms"] / 1000
    return model, model.training_flops_per_example * measured["batch_per_worker"] / step_s


def _probe_costs(probe: dict[str, Any], model, rate: float, batch: int) -> dict[tuple[str, str], float]:
    """(kind, link): the seconds a probe's step holds beyond the planner's prediction of it without any
    cost across hosts, a worker step's (a parameter-server job's step is a worker step over 2 workers)."""
    from tfdist.launch.hosts import link_bits_per_second

    costs = {}
    for kind in (k for k in NETWORK_KINDS if k in probe["table"]):
        for row in probe["table"][kind]:
            alone, _, _ = _predicted(model, rate, batch, kind, link_bits_per_second(row["link"]), 0.0)
            costs[kind, row["link"]] = max(0.0, (row["step_time_ms"] - alone) / 1000) * (
                2 if kind == "parameter_server" else 1)
    return costs


def _predicted(model, rate: float, batch: int, kind: str, link: float, latency: float, host_rate: float = 0.0,
               variable_latency: float = 0.0):
    """(the bench's step as the planner predicts it, its communication term, the step's terms) for a
    network job of `kind`: 2 hosts of a worker each, or both workers on one host and the server apart."""
    from tfdist.plan import Cluster, Layout
    from tfdist.plan.predict import predict

    if kind == "parameter_server":
        cluster = Cluster(devices=2, device_flops=rate, link=link, link_latency=latency, host_rate=host_rate,
                          variable_latency=variable_latency)
        step = predict(model, cluster, Layout(2, parameter_server=True), global_batch=2 * batch, micro_batches=1,
                       servers_apart=True).step_ms
        # The bench times the job a worker step at a time: 2 workers step at once.
        return step["total"] / 2, 1000 * model.weight_bytes / cluster.across_hosts, step
    cluster = Cluster(devices=2, hosts=2, device_flops=rate, link=link, link_latency=latency, host_rate=host_rate)
    step = predict(model, cluster, Layout(2), global_batch=2 * batch, micro_batches=1).step_ms
    return step["total"], 1000 * model.trainable_bytes / cluster.across_hosts, step  # 2 hosts' ring: its bytes once


def _overrides(command: str) -> list[str]:
    """The `--set` values of a job's command line (as the network bench records it)."""
    words = shlex.split(command)
    return [value for flag, value in zip(words, words[1:]) if flag == "--set"]
