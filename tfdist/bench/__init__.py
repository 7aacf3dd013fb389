"""Benchmarks behind `tfdist bench NAME`; each returns a JSON-ready dict.

The package holds what a user runs to measure their own job (synthetic, scaling, network, overhead);
the benchmarks that check tfdist itself (its figures against hand-written jobs, its plans, its
strategies' speedups) live in `benchmarks/` beside the package, and `tfdist bench` runs them from a
source checkout.

Every result has `benchmark`, the setting it ran in, the `machine` (CPU model,
cores and the CPU flags that matter, `tfdist.bench.machine`), and a `figures`
object with the numbers docs/figures.md quotes.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any, Optional

from tfdist.bench import jobs, machine
from tfdist.config.schema import Config
from tfdist.errors import ConfigError
from tfdist.tf_startup import import_tensorflow

__all__ = ["BENCHMARKS", "CONFIG_UNUSED", "one_line", "run"]

BENCHMARKS = {
    "baselines": "benchmarks.baselines",
    "checkpoint": "benchmarks.checkpoint",
    "data_parallel_pipeline": "benchmarks.data_parallel_pipeline",
    "horovod": "benchmarks.horovod_figures",  # not horovod.py: its scripts would import it as Horovod
    "input_pipeline": "benchmarks.input_pipeline",
    "layout": "benchmarks.layout",
    "network": "tfdist.bench.network",
    "overhead": "tfdist.bench.overhead",
    "parameter_server": "benchmarks.parameter_server",
    "pipeline": "benchmarks.pipeline",
    "plan": "benchmarks.plan",
    "plan_published": "benchmarks.plan_published",
    "precision": "benchmarks.precision",
    "ps_worker_loss": "benchmarks.ps_worker_loss",
    "remat": "benchmarks.remat",
    "scaling": "tfdist.bench.scaling",
    "sharded_optimizer": "benchmarks.sharded_optimizer",
    "synthetic": "tfdist.bench.synthetic",
    "tensor_parallel": "benchmarks.tensor_parallel",
}


# The benchmarks that set their own jobs refuse a config, saying why. Kept here, not in their modules,
# so that every refusal is one line at once, before TensorFlow takes seconds to load.
CONFIG_UNUSED = {
    "baselines": "it sets every job itself, the same on both sides.",
    "data_parallel_pipeline": "it sets its jobs itself.",
    "horovod": "it sets its jobs itself.",
    "input_pipeline": "it sets its own map, model and data.",
    "layout": "it sets its own devices, threads, model and layout map.",
    "parameter_server": "it sets both jobs itself.",
    "pipeline": "it sets its own devices, threads and model.",
    "plan": "it runs the jobs it plans (the network benchmark's, or the shipped pipeline and tensor-parallel configs).",
    "plan_published": "it plans the published runs' models on their clusters.",
    "precision": "it sets every job itself; only the precision changes within a kind.",
    "ps_worker_loss": "it kills workers of the parameter-server job it starts itself.",
    "remat": "it sets its own device, threads and models.",
    "sharded_optimizer": "it sets its own devices, threads and model.",
    "tensor_parallel": "it sets its own devices, threads and model.",
}

_PLOTTED = ("network", "scaling", "synthetic")
# The options (besides config and repeats) a benchmark takes from its own flags.
_OPTIONS = {"synthetic": ("model", "image_size", "batch_per_device"), "network": ("model", "links", "kinds"),
            "plan": ("links", "kinds")}


def run(name: str, *, config: Optional[Config] = None, repeats: int = 5, plot_path: Optional[str] = None,
        **options) -> dict[str, Any]:
    """Runs benchmark `name`; `config` replaces its default setting; `plot_path` (network, scaling,
    synthetic) gets its plot.

    A benchmark that fixes its own setting says why in `CONFIG_UNUSED` and is
    run through its `measure`; the others take the config in `run`. TensorFlow
    loads after the arguments are checked. `options`
    are those `_OPTIONS` lists for the benchmark (synthetic: `model`,
    `image_size`, `batch_per_device`; network: `model`, `links`, `kinds`; plan: `links`, `kinds`).
    """
    if plot_path and name not in _PLOTTED:
        takers = " or ".join(f"`bench {b}`" for b in _PLOTTED)
        raise ConfigError("plot", f"only applies to {takers}; {name} draws no plot.",
                          plot_path)
    if plot_path and importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("plot", "needs matplotlib, which is not installed: pip install 'tfdist[plots]'.", plot_path)
    for option, value in options.items():
        if option not in _OPTIONS.get(name, ()):
            takers = " or ".join(f"`bench {b}`" for b, taken in _OPTIONS.items() if option in taken)
            raise ConfigError(option, f"only applies to {takers}.", value)
    if name in CONFIG_UNUSED and config is not None:
        raise ConfigError("config", f"is not used by the {name} benchmark: {CONFIG_UNUSED[name]}", "given")
    if BENCHMARKS[name].startswith("benchmarks.") and not _checkout_on_path():
        raise ConfigError("benchmark", f"{name} checks tfdist itself and runs from a source checkout "
                          f"({BENCHMARKS[name].replace('.', '/')}.py beside the package), which this installation is not: clone "
                          "tfdist and run it there.", name)
    import_tensorflow()
    module = importlib.import_module(BENCHMARKS[name])
    if name in CONFIG_UNUSED:
        result = module.measure(repeats=repeats, **options)
    elif name in _PLOTTED:
        result = module.run(config=config, repeats=repeats, plot_path=plot_path, **options)
    else:
        result = module.run(config=config, repeats=repeats)
    return {**result, "machine": machine.describe()}


def _checkout_on_path() -> bool:
    """Puts the source checkout's root on `sys.path` where tfdist runs from one; False elsewhere."""
    if not os.path.exists(os.path.join(jobs.BENCHMARKS, "__init__.py")):
        return False
    if jobs.ROOT not in sys.path:
        sys.path.insert(0, jobs.ROOT)
    return True


def one_line(result: dict[str, Any]) -> str:
    """`name: key=value ...` of the figures, for the terminal."""
    figures = " ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
        for k, v in sorted(result["figures"].items())
    )
    return f"{result['benchmark']}: {figures}"
