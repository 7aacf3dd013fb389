"""Every layout the devices allow, with its memory per device and its step time, from a model's profile.

A layout is data parallel over `dp` replicas, each replica `stages`
pipeline stages of `tensor_parallel` devices each (stages x tensor_parallel
x dp = the devices), with the optimizer state split `zero` ways or not (ZeRO
3: the weights too, for data parallelism alone), with activations recomputed
(`remat`) or kept, or parameter servers. For each:

- **memory per device** (the fullest device): its stage's weights (a
  tensor-parallel layer's divided by the group), as many gradient bytes, the
  optimizer's slots for them (divided by dp when split), and activations:
  what the backward pass keeps of the stage's forward tensors for the
  examples in flight (a replica's batch; in a pipeline, micro-batches of it:
  all M under GPipe, K - stage under 1F1B; with recompute, each
  micro-batch's stage input), and one of them at its fullest in the backward
  pass (`_fullest_per_example`); with remat, what the profile traced with
  every layer that holds weights recomputing, and a layer's own tensors again
  while its backward pass runs;
  with ZeRO 3, 1/dp of the weights and gradients, and the largest layer's
  weights gathered whole (`gathered`);
- **step time**, with nothing overlapped (tfdist measured no overlap of
  all-reduce with the backward pass on CPUs): compute from the stage's
  training FLOPs at the device's sustained rate (with remat, one more
  forward pass of the recomputed layers; or, `measured`, the stages' own
  times on this machine); a pipeline runs M micro-batch slots of
  its slowest stage, and its bubble is the other stages' slots once (the
  first micro-batch passes through them before it reaches the slowest, the
  last after it): (K - 1)/(M + K - 1) of the step when the stages are even;
  tensor parallelism sums each of its layers' outputs across the
  group forward and backward; the stages pass activations and their
  gradients on; data parallelism all-reduces the gradients with a ring (2(N
  - 1)/N of the bytes; 3(N - 1)/N for ZeRO stage 1's all-reduce plus
  all-gather, and for ZeRO 3's two gathers and reduce-scatter), over the
  hosts' links when the replicas span hosts, where every device of a host
  sends its own ring's share at once; across hosts
  the cluster's `link_latency` (a step's fixed cost, when given) and its
  `host_rate` (the transport's own work on each byte: serializing, copying)
  add to the wire time; on a cluster whose devices share a host's cores
  (logical CPU devices, `host_cores`), a step's compute is at least all
  the host's devices' CPU time over its cores (their time times the cores
  each kept busy, as measured), and a tensor-parallel group's devices,
  which meet at every layer's sum, take turns;
- **parameter servers**: every device a worker that reads the weights at
  the start of its step and sends its gradients at its end, over its host's
  link for the servers on other hosts, asynchronously: its step is its own
  compute, reads and sends one after the other, where its reads share the
  link with the host's other workers reading at the same moment (and its
  sends with those sending: the link is full duplex). The workers' steps
  are not in step with each other, so another worker is reading for the
  share of its step its reads take (`_shared_link`). The link latency and
  the host rate count as for the ring, and `variable_latency` once for
  every trainable variable (each read and each update is an RPC of its own).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from tfdist.plan.cluster import Cluster, format_bytes
from tfdist.plan.profile import TRAINING_FLOPS_PER_FORWARD, ModelProfile

__all__ = ["Layout", "Prediction", "layouts", "predict", "recommended"]


@dataclasses.dataclass(frozen=True)
class Layout:
    dp: int
    stages: int = 1
    tensor_parallel: int = 1
    zero: int = 0
    parameter_server: bool = False
    mesh: bool = False  # `strategy.kind: layout`: its variables split over `tensor_parallel` devices
    remat: bool = False  # `train.remat: full`: the layers with weights recompute their forward pass

    @property
    def name(self) -> str:
        if self.parameter_server:
            return f"parameter servers, {self.dp} workers"
        if self.mesh:
            return f"layout: data {self.dp} x model {self.tensor_parallel}"
        parts = [f"data {self.dp}"]
        if self.stages > 1:
            parts.append(f"pipeline {self.stages}")
        if self.tensor_parallel > 1:
            parts.append(f"tensor {self.tensor_parallel}")
        name = " x ".join(parts)
        return name + (f", ZeRO {self.zero}" if self.zero else "") + (", remat" if self.remat else "")


@dataclasses.dataclass
class Prediction:
    layout: Layout
    memory: dict[str, float]  # bytes on the fullest device: weights, gradients, optimizer, activations, total
    fits: bool
    step_ms: dict[str, float]  # compute, bubble, tensor_parallel, pipeline, data_parallel, parameter_server, total
    samples_per_sec: float
    note: str = ""
    memory_by_stage: list = dataclasses.field(default_factory=list)  # each stage's first device, as `memory`
    scaling_efficiency: float = 0.0  # samples/sec over the devices' count times one device's alone (0: no rate)

    def to_dict(self) -> dict[str, Any]:
        return {"layout": self.layout.name, **dataclasses.asdict(self.layout), "memory_bytes": self.memory,
                "memory_bytes_by_stage": self.memory_by_stage, "fits": self.fits, "step_ms": self.step_ms,
                "samples_per_sec": self.samples_per_sec, "scaling_efficiency": self.scaling_efficiency,
                "note": self.note}


def layouts(model: ModelProfile, cluster: Cluster, *, global_batch: int, model_axis: int = 0) -> list[Layout]:
    """Every layout of `cluster`'s devices: stages and tensor-parallel groups within a host, dividing
    its devices; tensor parallelism only for a model with tensor-parallel layers. With `model_axis` (a
    config's `strategy.kind: layout`), its mesh alone: the model axis within a host, data parallel over
    the rest."""
    if model_axis:
        dp = cluster.devices // model_axis
        fits = cluster.per_host % model_axis == 0 and global_batch % dp == 0
        zeros = (0, 1, 2, 3) if dp > 1 else (0,)
        return [Layout(dp, tensor_parallel=model_axis, mesh=True, zero=zero, remat=remat) for zero in zeros
                for remat in (False, True)] if fits else []
    divisors = [k for k in range(1, cluster.per_host + 1) if cluster.per_host % k == 0]
    has_parallel_layers = any(layer.tensor_parallel for layer in model.layers)
    found = []
    for stages in divisors:
        for tensor in divisors:
            if stages * tensor > cluster.per_host or cluster.per_host % (stages * tensor):
                continue
            if tensor > 1 and not has_parallel_layers or stages > len(model.layers):
                continue
            dp = cluster.devices // (stages * tensor)
            if global_batch % dp:
                continue
            # ZeRO splits the state (and weights) over the data-parallel replicas: of a pipeline, or of tensor-
            # parallel groups, not yet of a pipeline whose stages are split.
            zeros = (0,) if dp == 1 or stages > 1 and tensor > 1 else (0, 1, 2, 3)
            found += [Layout(dp, stages, tensor, zero, remat=remat) for zero in zeros for remat in (False, True)]
    if cluster.devices > 1 and global_batch % cluster.devices == 0:
        found.append(Layout(cluster.devices, parameter_server=True))
    return found


def predict(model: ModelProfile, cluster: Cluster, layout: Layout, *, global_batch: int, micro_batches: int,
            schedule: str = "1f1b", recompute: bool = False, balance_by: str = "time",
            servers_apart: bool = False, measured=None) -> Prediction:
    """The memory and step time of `layout` for `model` on `cluster` (see the module docstring);
    `servers_apart`: a parameter-server layout's servers run on hosts of their own, not the workers';
    `measured` (`tfdist.plan.measure.MeasuredTimes`): a pipeline's stages are timed on this machine,
    not taken from the FLOPs rate."""
    from tfdist.parallel.partition import balance

    if layout.parameter_server:
        return _parameter_servers(model, cluster, layout, global_batch, servers_apart, measured)
    k, t, dp = layout.stages, layout.tensor_parallel, layout.dp
    batch = global_batch // dp  # a replica's examples a step
    m = micro_batches if k > 1 else 1
    if batch % m:
        return Prediction(layout, {}, False, {}, 0.0, note=f"a replica's batch of {batch} does not split into "
                                                           f"{m} micro-batches")
    micro = batch // m
    costs = [layer.trainable_bytes if balance_by == "params" else layer.forward_flops_per_example
             for layer in model.layers]
    starts = [0, *balance(costs, k), len(model.layers)] if k > 1 else [0, len(model.layers)]
    recomputed = _recomputed(model.layers) if layout.remat else {}
    stages = [model.layers[a:b] for a, b in zip(starts, starts[1:])]

    def share(layer, value):  # a layer's share on one device: what is split divided by the group, the rest whole
        return value * (1 - layer.split_fraction + layer.split_fraction / t)

    def other_share(layer, value):  # non-trainable weights: split by tfdist's tensor-parallel layers alone
        return value / t if layer.tensor_parallel else value

    memory_by_stage, compute_ms, tp_ms, moved_bytes = [], [], [], []
    rate = cluster.device_flops
    for index, layers in enumerate(stages):
        trainable = sum(share(layer, layer.trainable_bytes) for layer in layers)
        other = sum(other_share(layer, layer.other_bytes) for layer in layers)
        slots = model.slot_bytes * trainable / max(model.trainable_bytes, 1) / (dp if layout.zero else 1)
        # ZeRO 3: a 1/dp slice of the weights and their gradients, and one layer's whole weights gathered.
        gathered = max((layer.trainable_bytes for layer in layers), default=0) if layout.zero == 3 else 0
        held = trainable / dp if layout.zero == 3 else trainable
        in_flight = 1 if k == 1 else (m if schedule == "gpipe" else min(m, k - index))
        kept = [recomputed.get(layer.name, layer) for layer in layers]
        # The micro-batches waiting for their backward pass hold what it keeps (with recompute: only the
        # stage's input); the one in its backward pass holds the most it ever does, and with remat a
        # recomputed layer's own tensors again while its backward pass runs.
        waiting = layers[0].output_bytes_per_example if recompute and k > 1 else \
            sum(share(layer, layer.kept_bytes_per_example) for layer in kept)
        again = max((share(layer, layer.kept_bytes_per_example) for layer in layers
                     if layout.remat and (layer.trainable_bytes or layer.other_bytes)), default=0.0)
        activations = micro * ((in_flight - 1) * waiting + _fullest_per_example(kept, share) + again)
        memory_by_stage.append({"weights": held + other, "gradients": held, "optimizer": slots,
                                "activations": activations, **({"gathered": gathered} if gathered else {})})
        moved_bytes.append(trainable)
        flops = sum(share(layer, layer.forward_flops_per_example) for layer in layers) * TRAINING_FLOPS_PER_FORWARD
        flops += sum(share(layer, layer.forward_flops_per_example) for layer in layers
                     if layout.remat and (layer.trainable_bytes or layer.other_bytes))
        compute_ms.append(1000 * flops * micro / rate if rate else 0.0)
        # Each tensor-parallel layer's output is summed (or gathered) across the group, and its input
        # gradient in the backward pass: two ring all-reduces of the micro-batch's output.
        tp_bytes = sum(2 * 2 * (t - 1) / t * layer.output_bytes_per_example * micro
                       for layer in layers if layer.split_fraction and t > 1)
        tp_ms.append(1000 * tp_bytes / cluster.intra_link if tp_bytes and cluster.intra_link else 0.0)
    stage_ms = measured.stage_ms(k, micro) if measured is not None and k > 1 and t == 1 else []
    timed = bool(stage_ms)
    if timed:  # each stage's own time on a micro-batch, as the job cuts it
        compute_ms = stage_ms
    boundary = max((stage[-1].output_bytes_per_example for stage in stages[:-1]), default=0)
    # A stage passes each micro-batch's activations on, and their gradients back.
    pipeline_ms = 1000 * 2 * boundary * micro / cluster.intra_link if k > 1 and cluster.intra_link else 0.0
    slot_ms = [compute_ms[i] + tp_ms[i] + pipeline_ms for i in range(k)]  # one micro-batch on each stage
    slowest = max(range(k), key=lambda i: slot_ms[i])
    gradient_bytes = max(moved_bytes)  # whole: what the reductions (and ZeRO 3's gathers) move
    # ZeRO 3 gathers twice and reduce-scatters once for every micro-batch.
    factor = {0: 2, 1: 3, 2: 2, 3: 3 * m}[layout.zero] * (dp - 1) / dp
    if dp > 1 and cluster.hosts > 1:  # every device position's ring crosses the hosts' links at once
        moved = factor * gradient_bytes * (k * t)
        data_ms = cluster.crossing_ms(1000 * moved / cluster.across_hosts, moved)
    else:
        data_ms = 1000 * factor * gradient_bytes / cluster.intra_link if dp > 1 and cluster.intra_link else 0.0
    # The slowest stage paces the micro-batches; the first one passes through every other stage before it
    # reaches it, and the last one after it leaves (a flow shop's makespan): the bubble is the other stages'
    # slots, once; (K - 1)/(M + K - 1) of the step when the stages are even.
    step = {"compute": m * compute_ms[slowest], "tensor_parallel": m * tp_ms[slowest], "pipeline": m * pipeline_ms,
            "bubble": sum(slot_ms) - slot_ms[slowest], "data_parallel": data_ms}
    if cluster.host_cores:  # the host's devices share its cores: a step takes at least all their CPU time over them
        cpu_ms = measured.stage_cpu_ms(k, micro) if timed else [ms * _parallelism(measured) for ms in compute_ms]
        # A tensor-parallel group's devices meet at every layer's sum: on shared cores they take turns.
        floor = max(cluster.per_host // k * m * sum(cpu_ms) / cluster.host_cores, t * m * compute_ms[slowest])
        if floor > step["compute"] + step["bubble"]:
            step.update(compute=floor, bubble=0.0)
    if timed:  # the optimizer's update, the loss and metrics, Keras's work: once a step
        step["step_rest"] = measured.rest_ms
    step["total"] = sum(step.values())
    memory_by_stage = [{**memory, "total": sum(memory.values())} for memory in memory_by_stage]
    return _prediction(model, layout, max(memory_by_stage, key=lambda memory: memory["total"]), cluster, step,
                       global_batch, memory_by_stage)


def _recomputed(layers) -> dict:
    """With remat, each layer as the backward pass sees it, by name: keeping what the profile traced with every
    layer that holds weights recomputing."""
    return {layer.name: dataclasses.replace(layer, kept_bytes_per_example=layer.kept_bytes_per_example_remat)
            for layer in layers}


def _fullest_per_example(layers, share) -> float:
    """The most activation bytes an example holds at once in a training step over `layers`: while
    layer i's backward pass runs, what the backward pass keeps of layers up to i is still held, with
    the gradient arriving at its output and those of the tensors it kept (at least its output's size);
    at least all it keeps once the forward pass ends. (`share`: a tensor-parallel layer's part on one
    device.)"""
    kept, fullest = 0.0, 0.0
    for layer in layers:
        own = share(layer, layer.kept_bytes_per_example)
        kept += own
        fullest = max(fullest, kept + layer.output_bytes_per_example + max(own, layer.output_bytes_per_example))
    return max(fullest, kept)


def _parameter_servers(model: ModelProfile, cluster: Cluster, layout: Layout, global_batch: int,
                       servers_apart: bool, measured=None) -> Prediction:
    """Each device a worker of global_batch / workers examples a step (as many examples a step as the
    all-reduce layouts), reading the weights at the start of its step and sending the gradients at its
    end; the servers hold a share of the variables each, one on every host (or, `servers_apart`, on
    hosts of their own). A worker's step is its compute and its own reads and sends one after the
    other, the remote ones sharing its host's link with the host's other workers (`_shared_link`),
    the link's latency, the transport's work on them (`host_rate`) and an RPC's cost for each
    variable it reads and updates (`variable_latency`)."""
    weights, gradients = model.weight_bytes, model.trainable_bytes
    batch = global_batch // layout.dp
    memory = {"weights": weights, "gradients": gradients, "optimizer": 0.0,
              "activations": batch * _fullest_per_example(model.layers, lambda layer, value: value)}
    memory["total"] = sum(memory.values())
    rate = cluster.device_flops
    compute = 1000 * model.training_flops_per_example * batch / rate if rate else 0.0
    if cluster.host_cores:  # the host's workers share its cores
        compute = max(compute, cluster.per_host * compute * _parallelism(measured) / cluster.host_cores)
    remote = 1.0 if servers_apart else (cluster.hosts - 1) / cluster.hosts
    own = compute + (1000 * (1 - remote) * (weights + gradients) / cluster.intra_link if cluster.intra_link else 0.0)
    total = own
    if remote:
        link, moved = cluster.across_hosts, remote * (weights + gradients)
        own += 1000 * remote * cluster.variable_latency * model.trainable_variables  # a read and a send each
        reads, sends = _shared_link(1000 * remote * weights / link, 1000 * remote * gradients / link,
                                    own + cluster.crossing_ms(0.0, moved), cluster.per_host)
        total = own + cluster.crossing_ms(reads + sends, moved)
    step = {"compute": compute, "parameter_server": total - compute, "total": total}
    return _prediction(model, layout, memory, cluster, step, global_batch)


def _parallelism(measured) -> float:
    """The cores a device's step keeps busy, as measured (1 when not)."""
    return measured.parallelism if measured is not None else 1.0


def _shared_link(read_ms: float, send_ms: float, rest_ms: float, workers: int) -> tuple[float, float]:
    """How long a worker's reads and sends take (alone on the link: `read_ms`, `send_ms`) when `workers`
    of a host step over its link at once, each at its own phase: a worker is reading for the share of
    its step (`rest_ms` plus both) its reads take, so a read shares the link with (workers - 1) times
    that share of another reader, and takes read_ms times one plus it; sends likewise, the other way.
    The fixed point of that (the mean-field view of workers sharing a link) lies between perfect
    interleaving (the link busy all the time, each way) and every worker reading at the same moment."""
    reads, sends = read_ms, send_ms
    for _ in range(1000):
        step = rest_ms + reads + sends
        new = (read_ms * (1 + (workers - 1) * reads / step), send_ms * (1 + (workers - 1) * sends / step))
        if abs(new[0] - reads) + abs(new[1] - sends) < 1e-9 * step:
            return new
        reads, sends = new
    return reads, sends


def _prediction(model, layout, memory, cluster, step, examples, memory_by_stage=()) -> Prediction:
    fits = not cluster.device_memory or memory["total"] <= cluster.device_memory
    note = "" if fits else (f"does not fit: needs {format_bytes(memory['total'])} of "
                            f"{format_bytes(cluster.device_memory)}")
    speed = 1000 * examples / step["total"] if step["total"] > 0 else 0.0
    alone = cluster.device_flops / model.training_flops_per_example if model.training_flops_per_example else 0.0
    efficiency = speed / (cluster.devices * alone) if alone else 0.0
    return Prediction(layout, memory, fits, step, speed, note, list(memory_by_stage), efficiency)


def recommended(predictions: list[Prediction]) -> Optional[Prediction]:
    """The fastest layout that fits."""
    fitting = [p for p in predictions if p.fits and p.samples_per_sec > 0]
    return max(fitting, key=lambda p: p.samples_per_sec) if fitting else None
