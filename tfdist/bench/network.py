"""`tfdist bench network`: what the network costs each multi-process kind, on hosts with shaped links.

    tfdist bench network --links 100mbit,1gbit,10gbit --kinds multi_worker,horovod,parameter_server \\
        --json results/network.json --plot results/network.png

Every job is a whole `tfdist launch --hosts 2 --link RATE` run (network
namespaces of this machine, `tfdist.launch.hosts`; needs root), the same
model, data and batch per worker for every kind:

- `multi_worker`: 2 workers, one per host, MultiWorkerMirroredStrategy's ring
  all-reduce;
- `horovod`: 2 ranks, one per host, Horovod's all-reduce over Gloo;
- `parameter_server`: the chief and 2 workers on one host, the parameter
  server on the other, so every variable read and gradient sent crosses the link;
- `multi_worker_fp16`, `horovod_fp16`, `parameter_server_fp16`: each kind
  again with its gradients sent as float16 (`strategy.gradient_compression:
  fp16`, `horovod.fp16_compression: true`; a parameter-server worker still
  reads the variables in float32). Figure `compression_gain_KIND` is their
  samples/sec over the float32 job's at the slowest link, where communication
  dominates;
- `multi_worker_packed`: multi-worker with its gradients all-reduced in
  64 KiB packs (`strategy.bytes_per_pack`), last layer first, so that the
  first packs can leave during the backward pass: its `overlap` figures
  measure how much of the wire time that hides;
- `multi_worker_split`, `horovod_split`: the kind with the optimizer's state
  split over the workers or ranks (`strategy.shard_optimizer: 2`, ZeRO stage
  2): each gradient slice is reduce-scattered to its owner and the updated
  weights all-gathered, which together move an all-reduce's bytes. Figure
  `split_bytes_ratio_KIND` is its measured bytes over the unsplit job's (the
  larger direction, at the link where it is largest), `split_speed_ratio_KIND`
  its samples/sec over theirs at the slowest link. Dense models only: a
  sparse gradient would be made dense to be sliced.
- `multi_worker_split3`, `horovod_split3`: the weights split too
  (`strategy.shard_optimizer: 3`, every variable): each layer's weights are
  all-gathered for its forward and backward passes and the gradients
  reduce-scattered, 3 (N - 1) / N of the weights' bytes (its
  `algorithm_bytes`). Figure `split3_step_vs_split_KIND@LINK` is its step
  time over stage 2's at each link. `multi_worker_split3_no_prefetch` gathers
  each layer's weights only when its own input is there
  (`strategy.prefetch_weights: false`): figure `prefetch_gain_KIND@LINK` is
  its step time over the prefetching job's.

For each kind and link it reports samples/sec and the step time (wall clock,
completed work, as `tfdist train` measures them) and the bytes the reporting
host's link carried per measured step, read from the link's counters. Beside
them:

- `gradient_bytes`: one replica's dense gradients (the model's trainable
  weights). `--model sparse_embedding` (`tfdist.bench.sparse_workload`: a
  100,000-row embedding table that each batch touches sparsely) leaves the
  table out: its gradient is `sparse_gradient_bytes`, a batch's rows and their
  indices, against `table_bytes` for the whole table;
- `algorithm_bytes`: what the algorithm moves per step over that link. A ring
  all-reduce over N hosts sends and receives 2 (N - 1) / N x the gradient
  bytes, and all-gathers sparse rows; a parameter-server worker receives every
  variable (and row) it reads and sends its gradients. `bytes_vs_algorithm` =
  measured / algorithm (the larger direction); above 1.1 something is sent
  twice, or a sparse gradient went dense. `tcp_retransmits_per_step` counts
  the segments the host's TCP sent again over the same steps (a loaded
  machine's late acknowledgements): their bytes cross the link twice;
- `compute_ms`: the step with no communication at all, the same batch per
  worker trained by one process with one thread (strategy.kind=one_device), in
  the same rounds;
- `comm_ms`: the measured bytes over the link's rate (links are full duplex, so
  the larger direction);
- `overlap` = (compute + comm - step) / min(compute, comm): 0 when a step is
  compute then communication, 1 when the shorter hides wholly in the longer.
  Figure `overlap_KIND` is taken at the link where compute and comm are
  closest, where overlap matters most;
- `base_ms`: the same job's step at the fastest link less its comm_ms there:
  compute plus what a step of several processes costs besides bandwidth
  (collective launches, and here the hosts sharing 2 cores).
  `overlap_after_base` is the overlap with base_ms in place of compute_ms:
  how much of the wire time the step hides, once those costs are counted.

The hosts share this machine's cores, and the links add no latency: this shows
the cost of bandwidth, not of distance. Rounds alternate over the jobs; medians
are kept.
"""

from __future__ import annotations

import statistics
from typing import Any, Mapping, Optional, Sequence

from tfdist.bench import sparse_workload
from tfdist.bench.jobs import described, on_core, train_job
from tfdist.bench.plots import png
from tfdist.timing import alternate
from tfdist.config.schema import Config
from tfdist.config.sources import model_source
from tfdist.errors import ConfigError
from tfdist.launch.hosts import link_bits_per_second

__all__ = ["KINDS", "algorithm_bytes", "listed_links", "markdown_table", "measure", "measure_together", "overlap",
           "plot", "run"]

KINDS = ("multi_worker", "horovod", "parameter_server")
LINKS = ("100mbit", "1gbit", "10gbit")
HOSTS = 2
_LAUNCH = {  # each kind's `tfdist launch` flags (besides --hosts and --link) and strategy
    "multi_worker": (["--workers", "2"], ["strategy.kind=multi_worker_mirrored"]),
    "horovod": (["--workers", "2"], ["strategy.kind=horovod"]),
    "parameter_server": (["--workers", "2", "--ps", "1"], [
        "strategy.kind=parameter_server", "parameter_server.num_workers=2", "parameter_server.num_ps=1",
        "parameter_server.threads_per_task=1"]),
}
_COMPRESSED = {"multi_worker": "strategy.gradient_compression=fp16", "horovod": "horovod.fp16_compression=true",
               "parameter_server": "strategy.gradient_compression=fp16"}
# Gradients all-reduced in 64 KiB packs, last layer first, so that packs leave while earlier layers'
# gradients are still computed: the variant that measures how much of the wire time that hides.
_PACKED = {"multi_worker": "strategy.bytes_per_pack=65536"}
# Reduce-scatter + all-gather: an all-reduce's bytes.
_SPLIT = {"multi_worker": "strategy.shard_optimizer=2", "horovod": "strategy.shard_optimizer=2"}
# The weights split too (ZeRO 3), every variable: two all-gathers and a reduce-scatter, 1.5 all-reduces' bytes;
# and without prefetch (each layer's gather when its own input is there), for what prefetch gives.
_WEIGHTS_SPLIT = ["strategy.shard_optimizer=3", "strategy.keep_whole_below=0"]
_NO_PREFETCH = {"multi_worker": "strategy.prefetch_weights=false"}
SPARSE_MODEL = "sparse_embedding"  # --model's name for tfdist.bench.sparse_workload
BYTES_TOLERANCE = 1.10  # measured over algorithm bytes, per the target
OVERLAP_TARGET = 0.7
COMPRESSION_TARGET = 1.6  # samples/sec with float16 gradients over float32, where the link is the bottleneck


def run(*, config: Optional[Config] = None, repeats: int = 3, plot_path: Optional[str] = None,
        model: Optional[str] = None, links: Optional[str] = None, kinds: Optional[str] = None) -> dict[str, Any]:
    if config is not None:
        raise ConfigError("config", "is not used by the network benchmark: it sets its jobs itself "
                                    "(--model, --links, --kinds).", "given")
    if model and model != SPARSE_MODEL:
        model_source(model, "model")  # one line now rather than a dozen failed jobs
    link_list = listed_links(links)
    kind_list = _listed(kinds, KINDS, "kinds")
    unknown = [k for k in kind_list if k not in KINDS]
    if unknown:
        raise ConfigError("kinds", f"must be among {', '.join(KINDS)}.", ",".join(unknown))
    result = measure(model=model, links=link_list, kinds=kind_list, repeats=repeats)
    if plot_path:
        plot(result, plot_path)
        result["plot"] = plot_path
    return result


def listed_links(value: Optional[str]) -> list[str]:
    """`--links` as a list (LINKS when not given), every rate checked: one line now, not failed jobs later."""
    links = _listed(value, LINKS, "links")
    for link in links:
        link_bits_per_second(link)
    return links


def _listed(value: Optional[str], default: Sequence[str], key: str) -> list[str]:
    items = [item.strip() for item in value.split(",") if item.strip()] if value else list(default)
    if not items:
        raise ConfigError(key, "must list at least one item, comma-separated.", value)
    return items


def algorithm_bytes(kind: str, gradient_bytes: float, hosts: int = HOSTS,
                    slices: tuple[float, float] = (0.0, 0.0)) -> dict[str, float]:
    """Bytes per step the algorithm moves over the reporting host's link, each way.

    A ring all-reduce over `hosts` sends and receives 2 (hosts - 1) / hosts of the
    dense gradients (half as many bytes for a `_fp16` kind); a parameter-server
    worker receives the variables it reads (as many bytes as its gradients) and
    sends its gradients. `slices` is one worker's sparse gradient (an embedding's,
    as IndexedSlices): the bytes of its rows and of its indices. All-reduce kinds
    all-gather them (each host sends its own and receives the others'; float16
    compression leaves them as they are); a parameter-server worker reads those
    rows and sends rows and indices (the rows in float16 for
    `parameter_server_fp16`, with its dense gradients).
    """
    rows, indices = slices
    narrowed = 2 if kind.endswith("_fp16") else 1  # float16 halves the floating-point gradients, not indices
    if kind.startswith("parameter_server"):
        return {"sent": (gradient_bytes + rows) / narrowed + indices, "received": gradient_bytes + rows}
    passes = 3 if "_split3" in kind else 2  # ZeRO 3: two gathers of the weights and a reduce-scatter
    ring = passes * (hosts - 1) / hosts * gradient_bytes / narrowed
    gathered = (hosts - 1) * (rows + indices)
    return {"sent": ring + gathered, "received": ring + gathered}


def overlap(compute_ms: float, comm_ms: float, step_ms: float) -> float:
    """(compute + comm - step) / min(compute, comm): 0 for one after the other, 1 for fully hidden."""
    return (compute_ms + comm_ms - step_ms) / min(compute_ms, comm_ms)


def measure(*, model: Optional[str] = None, links: Sequence[str] = LINKS, kinds: Sequence[str] = KINDS,
            repeats: int = 3, batch_per_worker: int = 32, steps: int = 40, extra: Sequence[str] = (),
            variants: bool = True) -> dict[str, Any]:
    """Every kind (and, with `variants`, its fp16, packed and split variants) at every link; `extra`
    overrides end every job's (the plan benchmark's probes set their model there)."""
    return measure_together({"": dict(model=model, links=links, kinds=kinds, batch_per_worker=batch_per_worker,
                                      steps=steps, extra=extra, variants=variants)}, repeats=repeats)[""]


def measure_together(settings: Mapping[str, Mapping[str, Any]], *, repeats: int) -> dict[str, dict[str, Any]]:
    """Several `measure` settings (name -> its keyword arguments) in the same alternated rounds, every
    job of every setting in each round, so that their figures compare as one run's: the machine's
    drift over the minutes a run takes moves them all alike. Returns name -> that setting's result."""
    planned = {name: _Planned(**setting) for name, setting in settings.items()}
    rounds = alternate({f"{name}/{job}": train_job(overrides, launcher=() if command else on_core(0),
                                                   command=command or ("train",), read=_figures_of_job)
                        for name, setting in planned.items() for job, (command, overrides) in setting.jobs.items()},
                       repeats=repeats, warmup=0)
    return {name: setting.result({job: rounds[f"{name}/{job}"] for job in setting.jobs}, repeats)
            for name, setting in planned.items()}


class _Planned:
    """One setting's jobs (name -> (the `tfdist` command, or () for a one-process `train` on core 0; the
    overrides)), and its result from their rounds."""

    def __init__(self, *, model: Optional[str] = None, links: Sequence[str] = LINKS, kinds: Sequence[str] = KINDS,
                 batch_per_worker: int = 32, steps: int = 40, extra: Sequence[str] = (), variants: bool = True):
        self.model, self.links, self.batch_per_worker, self.steps = model, list(links), batch_per_worker, steps
        common = [
            "train.verbose=0", "train.epochs=1", f"train.steps_per_epoch={steps}",
            "callbacks.throughput_warmup_steps=10", "runtime.intra_op_threads=1", "runtime.inter_op_threads=2",
            f"train.global_batch_size={batch_per_worker}",
        ]
        if model == SPARSE_MODEL:
            common += [f"model.name={sparse_workload.__name__}:model",
                       f"data.dataset={sparse_workload.__name__}:dataset",
                       f"data.num_classes={sparse_workload.CLASSES}", *sparse_workload.TRAINING]
        elif model:  # a model of the user's: random 32x32 images, 10 classes
            common += [f"model.name={model}", "data.dataset=synthetic", "data.image_size=32", "data.channels=3",
                       "data.num_classes=10", f"data.synthetic_examples={batch_per_worker * 2 * steps}"]
        common += extra
        # One process on one core: a worker's share of this 2-core machine when 2 of them train.
        self.jobs: dict[str, tuple[list[str], list[str]]] = {
            "compute_only": ([], common + ["strategy.kind=one_device"])}
        self.chosen: dict[str, tuple[list[str], list[str]]] = {}
        for kind in kinds:
            flags, strategy = _LAUNCH[kind]
            # All-reduce kinds train 2 x batch_per_worker a step; a parameter-server step is one worker's batch.
            batch = [] if kind == "parameter_server" else [f"train.global_batch_size={2 * batch_per_worker}"]
            self.chosen[kind] = (flags, common + strategy + batch)
            if not variants:
                continue
            if kind in _COMPRESSED:
                self.chosen[f"{kind}_fp16"] = (flags, common + strategy + batch + [_COMPRESSED[kind]])
            if kind in _PACKED:
                self.chosen[f"{kind}_packed"] = (flags, common + strategy + batch + [_PACKED[kind]])
            if kind in _SPLIT and model != SPARSE_MODEL:
                self.chosen[f"{kind}_split"] = (flags, common + strategy + batch + [_SPLIT[kind]])
                self.chosen[f"{kind}_split3"] = (flags, common + strategy + batch + _WEIGHTS_SPLIT)
                if kind in _NO_PREFETCH:
                    self.chosen[f"{kind}_split3_no_prefetch"] = (
                        flags, common + strategy + batch + _WEIGHTS_SPLIT + [_NO_PREFETCH[kind]])
        for variant, (flags, overrides) in self.chosen.items():
            for link in self.links:
                self.jobs[f"{variant}@{link}"] = (["launch", *flags, "--hosts", str(HOSTS), "--link", link], overrides)

    def result(self, rounds: dict[str, list[dict[str, float]]], repeats: int) -> dict[str, Any]:
        results = {name: _median_result(values) for name, values in rounds.items()}
        compute = results.pop("compute_only")
        gradient_bytes, slices = compute["trainable_bytes"], (0, 0)
        if self.model == SPARSE_MODEL:  # the table's gradient is a batch's rows, not the table
            gradient_bytes -= sparse_workload.TABLE_BYTES
            slices = sparse_workload.gradient_slices(self.batch_per_worker)
        table = {variant: [_row(variant, link, results[f"{variant}@{link}"], compute,
                                algorithm_bytes(variant, gradient_bytes, slices=slices)) for link in self.links]
                 for variant in self.chosen}
        for rows in table.values():
            fastest = max(rows, key=lambda row: link_bits_per_second(row["link"]))
            for row in rows:
                row["base_ms"] = fastest["step_time_ms"] - fastest["comm_ms"]
                if "overlap" in row and row is not fastest:
                    row["overlap_after_base"] = overlap(row["base_ms"], row["comm_ms"], row["step_time_ms"])
        return {
            "benchmark": "network",
            "model": self.model or "the built-in digits CNN",
            "hosts": HOSTS,
            "batch_per_worker": self.batch_per_worker,
            "steps": self.steps,
            "repeats": repeats,
            "gradient_bytes": gradient_bytes,
            **({"sparse_gradient_bytes": dict(zip(("rows", "indices"), slices)),
                "table_bytes": sparse_workload.TABLE_BYTES} if self.model == SPARSE_MODEL else {}),
            "compute_only": {"step_time_ms": compute["step_time_ms"], "samples_per_sec": compute["samples_per_sec"]},
            "jobs": {name: f"tfdist {' '.join(command or ['train'])} " + described({name: o})[name]
                     for name, (command, o) in self.jobs.items()},
            "table": table,
            "samples": rounds,
            "figures": _figures(table),
        }


def _figures_of_job(metrics: dict[str, Any]) -> dict[str, float]:
    """What a round keeps of a job's `--metrics_out`."""
    link = {f"link_{direction}": value for direction, value in metrics.get("link_bytes_per_step", {}).items()}
    return {"samples_per_sec": metrics["samples_per_sec"], "step_time_ms": metrics["step_time_ms"],
            "trainable_bytes": metrics["trainable_bytes"], **link,
            "link_retransmits": metrics.get("link_retransmits_per_step", 0.0)}


def _median_result(values: list[dict[str, Any]]) -> dict[str, float]:
    return {key: statistics.median(v[key] for v in values) for key in values[0]}


def _row(kind: str, link: str, measured: dict[str, float], compute: dict[str, float],
         expected: dict[str, float]) -> dict[str, Any]:
    sent, received = measured["link_sent"], measured["link_received"]
    comm_ms = 1000 * max(sent, received) * 8 / link_bits_per_second(link)
    row = {
        "link": link,
        "samples_per_sec": measured["samples_per_sec"],
        "step_time_ms": measured["step_time_ms"],
        "link_bytes_per_step": {"sent": sent, "received": received},
        "tcp_retransmits_per_step": measured["link_retransmits"],  # segments this host's TCP sent again
        "algorithm_bytes": expected,
        "bytes_vs_algorithm": max(sent / expected["sent"], received / expected["received"]),
        "compute_ms": compute["step_time_ms"],
        "comm_ms": comm_ms,
    }
    if not kind.startswith("parameter_server"):  # its 2 workers step independently: not compute then comm
        row["overlap"] = overlap(compute["step_time_ms"], comm_ms, measured["step_time_ms"])
    return row


def _figures(table: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    figures: dict[str, Any] = {"compression_target": COMPRESSION_TARGET}
    for kind, rows in table.items():
        figures[f"bytes_vs_algorithm_{kind}"] = max(row["bytes_vs_algorithm"] for row in rows)
        for name, base in (("overlap", "compute_ms"), ("overlap_after_base", "base_ms")):
            # Taken at the link where the base and the wire time are closest, where overlap matters most.
            candidates = [row for row in rows if name in row]
            if candidates:
                closest = min(candidates, key=lambda row: abs(row[base] - row["comm_ms"]) / row[base])
                figures[f"{name}_{kind}"] = closest[name]
                figures[f"{name}_{kind}_link"] = closest["link"]
    for kind in _COMPRESSED:
        if f"{kind}_fp16" in table:
            slowest = _slowest_link(table[kind])
            figures[f"compression_gain_{kind}"] = (table[f"{kind}_fp16"][slowest]["samples_per_sec"]
                                                   / table[kind][slowest]["samples_per_sec"])
    for kind in _SPLIT:
        if f"{kind}_split" in table:
            pairs = list(zip(table[f"{kind}_split"], table[kind]))
            figures[f"split_bytes_ratio_{kind}"] = max(
                max(split["link_bytes_per_step"][d] / whole["link_bytes_per_step"][d] for d in ("sent", "received"))
                for split, whole in pairs)
            split, whole = pairs[_slowest_link(table[kind])]
            figures[f"split_speed_ratio_{kind}"] = split["samples_per_sec"] / whole["samples_per_sec"]
        if f"{kind}_split3" in table:  # ZeRO 3's step time over stage 2's, at every link
            for split3, split in zip(table[f"{kind}_split3"], table[f"{kind}_split"]):
                figures[f"split3_step_vs_split_{kind}@{split['link']}"] = split3["step_time_ms"] / split["step_time_ms"]
        if f"{kind}_split3_no_prefetch" in table:  # what prefetch gives: the step without it over the step with
            for late, early in zip(table[f"{kind}_split3_no_prefetch"], table[f"{kind}_split3"]):
                figures[f"prefetch_gain_{kind}@{early['link']}"] = late["step_time_ms"] / early["step_time_ms"]
    figures["bytes_within_tolerance"] = all(v <= BYTES_TOLERANCE for k, v in figures.items()
                                            if k.startswith("bytes_vs_algorithm_"))
    figures["overlap_target"] = OVERLAP_TARGET
    return figures


def _slowest_link(rows: list[dict[str, Any]]) -> int:
    """The index of the row at the slowest link, where communication dominates."""
    return min(range(len(rows)), key=lambda i: link_bits_per_second(rows[i]["link"]))


def markdown_table(result: dict[str, Any]) -> str:
    """The table as Markdown rows (for docs/figures.md)."""
    lines = ["| kind | link | samples/sec | step ms | compute ms | base ms | comm ms | overlap | overlap after base "
             "| link MB/step sent, received | algorithm MB | measured / algorithm |", "| --- " * 12 + "|"]
    for kind, rows in result["table"].items():
        for r in rows:
            link = r["link_bytes_per_step"]
            overlapped = [f"{r[key]:.2f}" if key in r else "-" for key in ("overlap", "overlap_after_base")]
            lines.append(f"| {kind} | {r['link']} | {r['samples_per_sec']:.0f} | {r['step_time_ms']:.2f} | "
                         f"{r['compute_ms']:.2f} | {r['base_ms']:.2f} | {r['comm_ms']:.2f} | {overlapped[0]} | "
                         f"{overlapped[1]} | {link['sent'] / 1e6:.3f}, {link['received'] / 1e6:.3f} | "
                         f"{r['algorithm_bytes']['sent'] / 1e6:.3f} | {r['bytes_vs_algorithm']:.3f} |")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str):
    """Samples/sec against link rate, one line per kind (log-scale rate); saved as PNG. Returns the figure."""
    with png(path) as (figure, axes):
        for kind, rows in result["table"].items():
            axes.plot([link_bits_per_second(r["link"]) / 1e9 for r in rows], [r["samples_per_sec"] for r in rows],
                      marker="o", label=kind)
        axes.set_xscale("log")
        axes.set_xlabel("link rate (Gbit/s), each of 2 hosts")
        axes.set_ylabel("samples/sec")
        axes.set_title(f"tfdist on 2 namespace hosts\n{result['model']}, {result['batch_per_worker']} per worker")
    return figure
