"""`tfdist plan`: its memory predictions against what a real job's devices hold, its step-time terms, and
the command a user runs."""

import dataclasses
import json
import os

import pytest
import yaml

from helpers import ROOT, run_tfdist, why_it_failed
from tfdist.errors import ConfigError
from tfdist.plan import Cluster, Layout, layout_overrides, make_plan, parse_bytes, parse_duration, parse_rate, profile
from tfdist.plan.cluster import HOST_LINK_EFFICIENCY, format_bytes
from tfdist.plan.predict import predict
from tfdist.plan.profile import LayerCost, ModelProfile

# TensorFlow runs already here: its thread counts stay as they are.
IN_THIS_PROCESS = ["runtime.intra_op_threads=0", "runtime.inter_op_threads=0"]


def test_sizes_and_rates_read_as_users_write_them():
    assert parse_bytes("80GiB", "--device_memory") == 80 * 2**30
    assert parse_bytes("16GB", "--device_memory") == 16e9
    assert parse_rate("100gbit", "--link") == 100e9
    assert parse_rate("600GB/s", "--intra_link") == 600e9 * 8
    assert parse_duration("2ms", "--link_latency") == pytest.approx(0.002)
    assert parse_duration("50us", "--link_latency") == pytest.approx(5e-5)
    for bad, parse in (("80 gigs", parse_bytes), ("fast", parse_rate), ("soon", parse_duration)):
        with pytest.raises(ConfigError, match="must be a"):
            parse(bad, "--flag")
    with pytest.raises(ConfigError, match="--link"):
        Cluster(devices=4, hosts=2)  # two hosts and no link between them
    with pytest.raises(ConfigError, match="multiple of --hosts"):
        Cluster(devices=3, hosts=2, link=1e9)


def _uniform_model(layers=8, flops=1e6, nbytes=4000, output=400):
    layer_costs = tuple(LayerCost(f"layer{i}", nbytes, 0, output, flops, output, True, trainable_variables=2)
                        for i in range(layers))
    return ModelProfile("uniform", layer_costs,
                        slot_bytes=2 * layers * nbytes, optimizer="Adam", compute_dtype="float32")


def test_the_step_time_is_its_terms():
    """The pipeline bubble is (K-1)/(M+K-1) of the step, a ring all-reduce moves 2(N-1)/N of the gradients
    (3(N-1)/N with ZeRO stage 1's all-gather), and tensor parallelism sums each layer's output twice."""
    model = _uniform_model()
    cluster = Cluster(devices=4, device_flops=1e9, intra_link=1e9)
    pipe = predict(model, cluster, Layout(1, stages=4), global_batch=32, micro_batches=8, balance_by="params")
    step = pipe.step_ms
    assert step["bubble"] / step["total"] == pytest.approx(3 / 11)
    assert step["compute"] == pytest.approx(1000 * 3 * 2 * 1e6 * 4 * 8 / 1e9)  # 2 layers a stage, 8 x 4 examples
    for zero, factor in ((0, 2), (1, 3), (2, 2), (3, 3)):
        data = predict(model, cluster, Layout(4, zero=zero), global_batch=32, micro_batches=1).step_ms
        assert data["data_parallel"] == pytest.approx(1000 * factor * 3 / 4 * 32000 / 1e9)
    # A pipeline at ZeRO 3 gathers a stage's weights twice and reduce-scatters them once per micro-batch.
    split_pipe = predict(model, cluster, Layout(2, stages=2, zero=3), global_batch=32, micro_batches=4,
                         balance_by="params").step_ms
    assert split_pipe["data_parallel"] == pytest.approx(1000 * 3 * 4 * 1 / 2 * 16000 / 1e9)
    across = Cluster(devices=4, hosts=2, device_flops=1e9, intra_link=1e9, link=8e9 / HOST_LINK_EFFICIENCY)
    ring = predict(model, across, Layout(4), global_batch=32, micro_batches=1).step_ms["data_parallel"]
    assert ring == pytest.approx(1000 * 2 * 3 / 4 * 32000 / 1e9)  # the ring's bytes over the link's 1 GB/s of data
    # A step's fixed cost across hosts adds to the wire time.
    slow = dataclasses.replace(across, link_latency=0.002)
    assert predict(model, slow, Layout(4), global_batch=32, micro_batches=1).step_ms[
        "data_parallel"] == pytest.approx(ring + 2.0)
    # The transport's own work on the bytes adds to the wire: at the link's own rate, it doubles the ring.
    copying = dataclasses.replace(across, host_rate=1e9)
    assert predict(model, copying, Layout(4), global_batch=32, micro_batches=1).step_ms[
        "data_parallel"] == pytest.approx(2 * ring)
    plain = predict(model, cluster, Layout(4), global_batch=32, micro_batches=1)
    assert plain.scaling_efficiency == pytest.approx(plain.step_ms["compute"] / plain.step_ms["total"])
    tensor = predict(model, cluster, Layout(1, tensor_parallel=4), global_batch=32, micro_batches=1)
    assert tensor.step_ms["tensor_parallel"] == pytest.approx(1000 * 8 * 2 * 2 * 3 / 4 * 400 * 32 / 1e9)
    assert tensor.memory["weights"] == pytest.approx(8 * 4000 / 4)
    no_link = Cluster(devices=4, device_flops=1e9)  # no --intra_link: what moves within the host is not counted
    assert predict(model, no_link, Layout(1, tensor_parallel=4), global_batch=32,
                   micro_batches=1).step_ms["tensor_parallel"] == 0
    small = Cluster(devices=4, device_memory=2**16, device_flops=1e9, intra_link=1e9)
    squeezed = predict(model, small, Layout(4), global_batch=32, micro_batches=1)
    assert not squeezed.fits
    assert squeezed.note == f"does not fit: needs {format_bytes(squeezed.memory['total'])} of 64 KiB"


def test_a_parameter_server_worker_reads_and_sends_in_turn_sharing_its_hosts_link_with_its_other_workers():
    """Reads at the start of a step and sends at its end, one after the other; a host's workers share its
    link, each direction on its own (full duplex), at phases of their own: between the link busy all the
    time and every worker reading at once."""
    model = _uniform_model()  # 32000 trainable bytes
    link = 1e6 * 8 / HOST_LINK_EFFICIENCY  # 1 MB/s of data
    alone = Cluster(devices=2, hosts=2, device_flops=1e9, link=link)
    step = predict(model, alone, Layout(2, parameter_server=True), global_batch=32, micro_batches=1).step_ms
    compute = 1000 * 3 * 8e6 * 16 / 1e9
    assert step["total"] == pytest.approx(compute + 1000 * 0.5 * 64000 / 1e6)  # half the variables on the other host
    wire = 1000 * 32000 / 1e6  # a worker's reads (or sends) alone on the link, ms
    for workers in (2, 8):
        crowded = Cluster(devices=workers, device_flops=1e12, link=link)  # the servers on a host apart
        step = predict(model, crowded, Layout(workers, parameter_server=True), global_batch=32 * workers,
                       micro_batches=1, servers_apart=True).step_ms
        # Next to no compute: a read shares the link with (workers - 1) / 2 others on average, so a
        # step is (workers + 1) times a read alone; the link's bound is workers times, every worker at
        # once 2 x workers times.
        assert step["total"] == pytest.approx((workers + 1) * wire, rel=0.01)
    busy = Cluster(devices=2, device_flops=1.2e10, link=link)
    step = predict(model, busy, Layout(2, parameter_server=True), global_batch=64, micro_batches=1,
                   servers_apart=True).step_ms
    # Compute as long as the reads and sends: the other worker reads for less of the time, so a read waits less.
    assert step["compute"] == pytest.approx(2 * wire) and 2.4 * wire < step["parameter_server"] < 2.7 * wire
    # The link's latency and the transport's work on the bytes add to the wire.
    slow_transport = dataclasses.replace(alone, host_rate=0.5e6, link_latency=0.010)
    step = predict(model, slow_transport, Layout(2, parameter_server=True), global_batch=32, micro_batches=1).step_ms
    assert step["total"] == pytest.approx(compute + 10 + 1000 * 0.5 * 64000 / 0.5e6 + 1000 * 0.5 * 64000 / 1e6)
    # Each of the 16 variables costs its read's and its update's RPCs, for the half that is remote.
    rpcs = dataclasses.replace(alone, variable_latency=0.001)
    step = predict(model, rpcs, Layout(2, parameter_server=True), global_batch=32, micro_batches=1).step_ms
    assert model.trainable_variables == 16
    assert step["total"] == pytest.approx(compute + 0.5 * 16 + 1000 * 0.5 * 64000 / 1e6)
    ring = predict(model, rpcs, Layout(2), global_batch=32, micro_batches=1).step_ms
    assert ring == predict(model, alone, Layout(2), global_batch=32, micro_batches=1).step_ms  # one packed collective


# Each config and overrides, the layout they train, and each stage's first device.
JOBS = {
    "mirrored": ("configs/default.yaml", ["strategy.logical_devices=2"], Layout(2), ["CPU:0"]),
    "mirrored_zero_1": ("configs/default.yaml", ["strategy.logical_devices=2", "strategy.shard_optimizer=1"],
                        Layout(2, zero=1), ["CPU:0"]),
    "mirrored_zero_2": ("configs/default.yaml", ["strategy.logical_devices=4", "strategy.shard_optimizer=2"],
                        Layout(4, zero=2), ["CPU:0"]),
    "mirrored_zero_3": ("configs/default.yaml", ["strategy.logical_devices=2", "strategy.shard_optimizer=3",
                                                 "strategy.keep_whole_below=0"], Layout(2, zero=3), ["CPU:0"]),
    "pipeline": ("configs/pipeline.yaml", ["pipeline.balance_by=params"], Layout(2, stages=2), ["CPU:0", "CPU:1"]),
    "pipeline_zero_3": ("configs/pipeline.yaml", ["pipeline.balance_by=params", "strategy.shard_optimizer=3",
                                                  "strategy.keep_whole_below=0"], Layout(2, stages=2, zero=3),
                        ["CPU:0", "CPU:1"]),
    "tensor_parallel": ("configs/tensor_parallel.yaml", [], Layout(1, tensor_parallel=2), ["CPU:0"]),
    "pipeline_tensor_parallel": ("configs/pipeline_tensor_parallel.yaml", ["pipeline.balance_by=params"],
                                 Layout(1, stages=2, tensor_parallel=2), ["CPU:0", "CPU:2"]),
    "layout": ("configs/layout.yaml", [], Layout(1, tensor_parallel=2, mesh=True), ["CPU:0"]),
    "layout_data_axis": ("configs/layout.yaml", ["strategy.logical_devices=4", "layout.data_devices=2"],
                         Layout(2, tensor_parallel=2, mesh=True), ["CPU:0"]),
    "layout_data_axis_zero_3": ("configs/layout.yaml", ["strategy.logical_devices=4", "layout.data_devices=2",
                                                        "strategy.shard_optimizer=3", "strategy.keep_whole_below=0"],
                                Layout(2, tensor_parallel=2, mesh=True, zero=3), ["CPU:0"]),
}


@pytest.mark.parametrize("job", JOBS)
def test_predicted_weight_and_optimizer_bytes_are_what_each_device_holds(job):
    """Within 5% of the bytes of the variables (and of the optimizer's slots) on each stage's first
    device, the fullest, after a real step of the same job on logical CPUs."""
    from tfdist import training
    from tfdist.config import load_config
    from tfdist.parallel.optimizer_shards import held_variables
    from tfdist.strategies.replica_groups import bytes_by_device

    path, overrides, layout, devices = JOBS[job]
    config = load_config(os.path.join(ROOT, path), [*overrides, *IN_THIS_PROCESS, "train.steps_per_epoch=1"])
    cluster = Cluster(devices=layout.dp * layout.stages * layout.tensor_parallel, device_flops=1e9, intra_link=1e9)
    model = profile(config)
    predicted = predict(model, cluster, layout, global_batch=config.train.global_batch_size,
                        micro_batches=config.pipeline.num_micro_batches, balance_by=config.pipeline.balance_by.value)
    job_ = training.prepare(config)
    job_.model.fit(job_.train_data, epochs=1, steps_per_epoch=1, verbose=0)
    weights = bytes_by_device(job_.model.weights)
    slots = bytes_by_device([v for v in held_variables(job_.model.optimizer) if len(v.shape)])
    assert len(predicted.memory_by_stage) == len(devices)
    for stage, device in zip(predicted.memory_by_stage, devices):
        assert stage["weights"] == pytest.approx(weights[device], rel=0.05), (device, stage, weights)
        assert stage["optimizer"] == pytest.approx(slots[device], rel=0.05), (device, stage, slots)


def test_predicted_activations_with_remat_are_what_the_probe_measures_and_cost_a_forward_pass():
    """The profile traces the model again with every layer with weights recomputing: what it keeps per example
    is what a model built and recomputed apart keeps (the probe), within 5%; a recomputing layout holds less
    and steps slower by the recomputed layers' forward pass."""
    import tensorflow as tf

    from tfdist import data, models, remat
    from tfdist.config import load_config
    from tfdist.plan.profile import kept_bytes

    config = load_config(None, ["model.name=transformer", "model.width=64", "model.depth=2", "model.heads=4",
                                *IN_THIS_PROCESS])
    model = profile(config)
    predicted = sum(layer.kept_bytes_per_example_remat for layer in model.layers)
    source = data.load_source(config.data, seed=1, steps_per_epoch_set=True)
    built = models.build(config.model, input_shape=source.input_shape, num_classes=source.num_classes)
    remat(built, "full")
    measured = (kept_bytes(built, tf.TensorSpec((2, *source.input_shape), "float32"))
                - kept_bytes(built, tf.TensorSpec((1, *source.input_shape), "float32")))
    assert predicted == pytest.approx(measured, rel=0.05)
    assert predicted < 0.3 * sum(layer.kept_bytes_per_example for layer in model.layers)
    cluster = Cluster(devices=1, device_flops=1e9)
    kept, again = (predict(model, cluster, Layout(1, remat=remat_), global_batch=64, micro_batches=1)
                   for remat_ in (False, True))
    assert again.memory["activations"] < 0.5 * kept.memory["activations"]
    forward = sum(layer.forward_flops_per_example for layer in model.layers if layer.trainable_bytes)
    assert again.step_ms["compute"] - kept.step_ms["compute"] == pytest.approx(1000 * forward * 64 / 1e9)


def test_the_planner_proposes_stage_3_or_remat_where_only_they_fit():
    """Memory alone too small for the unsplit weights and state: the fastest layout that fits splits the
    weights (ZeRO 3) or recomputes; its overrides make a config `tfdist train` takes."""
    from tfdist.config import load_config

    config = load_config(None, ["model.name=transformer", "model.width=64", "model.depth=2", "model.heads=4",
                                *IN_THIS_PROCESS])
    model = profile(config)
    rows = {row["layout"]: row for row in make_plan(config, Cluster(devices=4, device_flops=1e9,
                                                                     intra_link=1e9))["layouts"]}
    assert {"data 4, ZeRO 3", "data 4, ZeRO 3, remat", "data 4, remat"} <= set(rows)
    zero_2, zero_3 = rows["data 4, ZeRO 2"]["memory_bytes"], rows["data 4, ZeRO 3"]["memory_bytes"]
    assert zero_3["weights"] < zero_2["weights"] and zero_3["gathered"] > 0
    # Between ZeRO 3's memory and ZeRO 2's: only the split weights fit.
    limit = (zero_2["total"] + zero_3["total"]) / 2
    result = make_plan(config, Cluster(devices=4, device_flops=1e9, intra_link=1e9, device_memory=limit), model)
    best = result["recommended"]
    assert best["zero"] == 3 and best["fits"], best
    config = load_config(None, ["model.name=transformer", *result["recommended_overrides"]])
    assert config.strategy.shard_optimizer == 3 and config.strategy.kind == "mirrored"


def test_uneven_stages_leave_the_other_stages_slots_as_bubble_and_shared_cores_bound_the_step():
    """A flow shop's makespan: the slowest stage paces the micro-batches and the others' slots come once;
    on devices that share a host's cores, a step takes at least all their CPU time over the cores."""

    class Timed:  # what `MeasuredTimes` gives the planner
        rest_ms, parallelism = 1.5, 1.0

        def stage_ms(self, stages, micro_batch):
            assert (stages, micro_batch) == (2, 8)
            return [3.0, 1.0]

        def stage_cpu_ms(self, stages, micro_batch):
            return [6.0, 1.0]  # the first stage keeps 2 cores busy

    model = _uniform_model()
    cluster = Cluster(devices=2, device_flops=1e9)
    layout = Layout(1, stages=2)
    step = predict(model, cluster, layout, global_batch=32, micro_batches=4, measured=Timed()).step_ms
    assert (step["compute"], step["bubble"], step["step_rest"]) == (4 * 3.0, 1.0, 1.5)
    assert step["total"] == pytest.approx(12 + 1 + 1.5)
    two_cores = dataclasses.replace(cluster, host_cores=2)  # 4 x 7 ms of CPU over 2 cores: longer than 13
    step = predict(model, two_cores, layout, global_batch=32, micro_batches=4, measured=Timed()).step_ms
    assert (step["compute"], step["bubble"]) == (4 * 7.0 / 2, 0.0)
    four_cores = dataclasses.replace(cluster, host_cores=4)  # enough cores: the schedule is the step
    step = predict(model, four_cores, layout, global_batch=32, micro_batches=4, measured=Timed()).step_ms
    assert (step["compute"], step["bubble"]) == (12.0, 1.0)
    # Without the stages' times, uneven layers cut by FLOPs: 3 layers of 1, 1 and 4 MFLOPs, as 2 and 4.
    uneven = dataclasses.replace(model, layers=tuple(dataclasses.replace(layer, forward_flops_per_example=flops)
                                                     for layer, flops in zip(model.layers, (1e6, 1e6, 4e6))))
    step = predict(uneven, cluster, layout, global_batch=32, micro_batches=4).step_ms
    per_mflop = 1000 * 3 * 8 * 1e6 / 1e9  # ms a forward MFLOP of one example costs a micro-batch of 8 in training
    assert step["compute"] == pytest.approx(4 * 4 * per_mflop) and step["bubble"] == pytest.approx(2 * per_mflop)
    one_core = dataclasses.replace(cluster, host_cores=1)
    data = predict(uneven, one_core, Layout(2), global_batch=32, micro_batches=1).step_ms
    assert data["compute"] == pytest.approx(2 * 6 * 16 * per_mflop / 8)  # both replicas' 16 examples on one core
    workers = predict(uneven, one_core, Layout(2, parameter_server=True), global_batch=32, micro_batches=1).step_ms
    assert workers["compute"] == pytest.approx(data["compute"])  # a worker's step shares the core with the other
    # A tensor-parallel group meets at every layer: on shared cores its devices take turns, however many cores.
    plenty = dataclasses.replace(cluster, host_cores=8)
    alone = predict(model, cluster, Layout(1, tensor_parallel=2), global_batch=32, micro_batches=1).step_ms
    turns = predict(model, plenty, Layout(1, tensor_parallel=2), global_batch=32, micro_batches=1).step_ms
    assert turns["compute"] == pytest.approx(2 * alone["compute"])


def test_measure_times_the_stages_as_the_job_cuts_them(tmp_path):
    table = tmp_path / "plan.json"
    proc = run_tfdist("plan", "--config", "configs/pipeline.yaml", "--devices", "2", "--measure", "--json",
                      str(table), timeout=400)
    assert proc.returncode == 0, why_it_failed(proc.stderr)
    result = json.loads(table.read_text())
    measured, cluster = result["measured"], result["cluster"]
    cores = len(os.sched_getaffinity(0))
    assert cluster["host_cores"] == cores and f"logical CPU devices sharing its {cores} cores" in cluster["source"]
    assert measured["batch"] == 32 and measured["rest_ms"] == pytest.approx(
        max(0.0, measured["step_ms"] - measured["forward_backward_ms"]))
    assert cluster["device_flops"] == pytest.approx(
        result["model"]["training_flops_per_example"] * 32 / (measured["step_ms"] / 1000))
    key = "2 stages, micro-batch 16"  # the config's 4 micro-batches of 64 examples
    stages, cpu = measured["stage_ms"][key], measured["stage_cpu_ms"][key]
    assert len(stages) == 2 and all(ms > 0 for ms in stages) and 0 < measured["parallelism"] <= cores + 0.5
    step = next(row for row in result["layouts"] if row["layout"] == "data 1 x pipeline 2")["step_ms"]
    schedule = 4 * max(stages) + min(stages)  # the slowest stage paces 4 micro-batches; the other's slot once
    assert step["compute"] + step["bubble"] == pytest.approx(max(schedule, 4 * sum(cpu) / cores))
    assert step["step_rest"] == pytest.approx(measured["rest_ms"])


def test_the_plan_command_prints_the_layouts_and_writes_a_config_train_takes(tmp_path):
    out, table = tmp_path / "plan.yaml", tmp_path / "plan.json"
    proc = run_tfdist("plan", "--config", "configs/pipeline.yaml", "--devices", "4", "--device_memory", "64MiB",
                      "--device_tflops", "0.05", "--intra_link", "10GB/s", "--out", str(out), "--json", str(table),
                      timeout=300)
    assert proc.returncode == 0, why_it_failed(proc.stderr)
    result = json.loads(table.read_text())
    names = [row["layout"] for row in result["layouts"]]
    assert {"data 4", "data 4, ZeRO 1", "data 4, ZeRO 2", "data 2 x pipeline 2", "data 1 x pipeline 4",
            "parameter servers, 4 workers"} <= set(names)
    speeds = [row["samples_per_sec"] for row in result["layouts"] if row["fits"]]
    assert speeds == sorted(speeds, reverse=True)  # fastest first
    best = result["recommended"]
    assert best["layout"] == names[0] and f"recommended: {best['layout']}" in proc.stdout
    assert "memory on the fullest device" in proc.stdout and best["layout"] in proc.stdout
    assert proc.stdout.startswith("4 devices on 1 host(s), digits_cnn, global batch 64 (flags)")
    written = yaml.safe_load(out.read_text().split("\n", 1)[1])
    from tfdist.config import load_config

    check = load_config(str(out), [])  # the file tfdist train takes, as it is
    assert check.strategy.logical_devices == 4 and written["strategy"]["kind"] == check.strategy.kind


def test_the_links_latency_host_rate_and_variable_latency_flags_reach_the_cross_host_terms(tmp_path):
    table = tmp_path / "plan.json"
    proc = run_tfdist("plan", "--devices", "4", "--hosts", "2", "--device_tflops", "1", "--link", "1gbit",
                      "--link_latency", "20ms", "--host_rate", "300MB/s", "--variable_latency", "0.2ms", "--json",
                      str(table), timeout=300)
    assert proc.returncode == 0, why_it_failed(proc.stderr)
    result = json.loads(table.read_text())
    assert result["cluster"]["link_latency"] == pytest.approx(0.020) and result["cluster"]["host_rate"] == 3e8
    assert result["cluster"]["variable_latency"] == pytest.approx(2e-4)
    assert result["model"]["trainable_variables"] == 8  # the digits CNN: 2 convolutions and 2 dense layers
    data = next(row for row in result["layouts"] if row["layout"] == "data 4")
    ring = 2 * 3 / 4 * result["model"]["trainable_bytes"]  # bytes a host's link carries each way
    wire = 1000 * ring / (HOST_LINK_EFFICIENCY * 1e9 / 8)
    assert data["step_ms"]["data_parallel"] == pytest.approx(20 + wire + 1000 * ring / 3e8)


def test_without_the_devices_speed_the_plan_says_which_layouts_fit_and_times_none(tmp_path):
    """The issue's own first command gives no speed: memory alone answers whether a layout fits."""
    table = tmp_path / "plan.json"
    proc = run_tfdist("plan", "--config", "configs/default.yaml", "--devices", "8", "--hosts", "2", "--device_memory",
                      "600KiB", "--link", "100gbit",
                      "--intra_link", "600GB/s", "--json", str(table), timeout=300)
    assert proc.returncode == 0, why_it_failed(proc.stderr)
    rows = json.loads(table.read_text())["layouts"]
    assert all(row["step_ms"] == {} and row["samples_per_sec"] == 0 for row in rows)
    fitting = [row["fits"] for row in rows]
    assert fitting == sorted(fitting, reverse=True) and 0 < sum(fitting) < len(rows)  # those that fit first
    whole = next(row for row in rows if row["layout"] == "data 8")  # Adam's slots on every device: too big
    assert not whole["fits"]
    assert whole["note"] == f"does not fit: needs {format_bytes(whole['memory_bytes']['total'])} of 600 KiB"
    assert proc.stdout.rstrip().endswith(
        "recommended: none without the devices' speed (--device_tflops, a --cluster preset or --measure); "
        f"{sum(fitting)} of {len(rows)} layouts fit")


@pytest.mark.parametrize("args, message", [
    ((), "`plan` needs the devices: --devices N"),
    (("--devices", "2", "--out", "plan.yaml"),
     "`plan --out` writes the fastest layout, so it needs the devices' speed: --device_tflops, a --cluster preset or "
     "--measure"),
    (("--cluster", "9x9-tpu"), "`--cluster` must be one of 1x8-a100-80g, 2x8-a100-80g-ib, 1x8-v100-32g"),
    (("--devices", "2", "--device_tflops", "1", "--device_memory", "lots"), "`--device_memory` must be a size"),
    (("--devices", "2", "--device_tflops", "1", "--host_rate", "fast"), "`--host_rate` must be a rate"),
])
def test_a_plan_without_what_it_needs_is_one_line(args, message):
    proc = run_tfdist("plan", *args)
    assert proc.returncode == 2 and proc.stderr.strip().endswith(proc.stderr.strip().splitlines()[-1])
    assert message in proc.stderr.strip().splitlines()[-1], proc.stderr


def test_the_recommended_overrides_make_a_config_of_each_layout():
    from tfdist.config import load_config

    two_hosts = Cluster(devices=8, hosts=2, device_flops=1e12, link=1e10, intra_link=1e11)
    for layout, kind in ((Layout(8, zero=2), "multi_worker_mirrored"), (Layout(2, stages=2, tensor_parallel=2),
                                                                          "pipeline"),
                         (Layout(4, tensor_parallel=2), "tensor_parallel"), (Layout(8, parameter_server=True),
                                                                             "parameter_server")):
        config = load_config(None, ["model.name=transformer", *layout_overrides(layout, two_hosts, 64)])
        assert config.strategy.kind == kind


def test_a_preset_plans_a_transformer_on_two_hosts():
    from tfdist.config import load_config
    from tfdist.plan import from_preset

    config = load_config(os.path.join(ROOT, "configs/tensor_parallel.yaml"), [*IN_THIS_PROCESS,
                                                                              "train.global_batch_size=256"])
    cluster = from_preset("2x8-a100-80g-ib", None, "float32")
    assert cluster.devices == 16 and cluster.hosts == 2 and "A100" in cluster.source
    result = make_plan(config, cluster)
    assert result["recommended"] and all(row["fits"] for row in result["layouts"] if row["memory_bytes"])
    assert any(row["tensor_parallel"] == 8 for row in result["layouts"])
