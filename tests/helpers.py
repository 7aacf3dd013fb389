"""Helpers for tests that run tfdist in subprocesses."""

import ast
import collections
import json
import os
import pty
import re
import subprocess
import sys

import pytest

from machine_speed import slowness
import zygote
from tfdist.cluster.loopback import free_loopback_ports as free_ports  # noqa: F401
from tfdist.launch.process_tree import descendants

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The scripts tests run as processes (and import from): tests/scenarios/NAME.
SCENARIO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scenarios")
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")
# What TensorFlow prints at import before its logging starts, whatever TF_CPP_MIN_LOG_LEVEL says
# (on some CPUs: "oneDNN custom operations are on"): info lines, and the warning that precedes them.
_TENSORFLOW_STARTUP = re.compile(r"^(WARNING: All log messages before absl::InitializeLog\(\)|I\d{4} \d\d:\d\d:\d\d)")


def doc_pages():
    """The README and every page of docs/, as paths relative to the repository."""
    pages = ["README.md"]
    for directory, _, files in sorted(os.walk(os.path.join(ROOT, "docs"))):
        pages += sorted(os.path.relpath(os.path.join(directory, f), ROOT) for f in files if f.endswith(".md"))
    return pages


def doc_blocks(language):
    """(page, index in that page, text) of every ```LANGUAGE block of the README and docs/."""
    found = []
    for page in doc_pages():
        with open(os.path.join(ROOT, page), encoding="utf-8") as f:
            blocks = re.findall(rf"```{language}\n(.*?)```", f.read(), re.S)
        found += [(page, index, block) for index, block in enumerate(blocks)]
    return found


def why_it_failed(output: str) -> str:
    """The part of a failed process's output that says why: a native crash's stacks (not the
    extension modules the faulthandler lists after them), else the last Python traceback (not
    the gRPC shutdown noise printed after it), else the tail."""
    for start in (output.find("Fatal Python error"), output.rfind("Traceback (most recent call last)")):
        if start >= 0:
            return output[start:start + 6000]
    return output[-3000:]


def user_lines(stderr):
    """The lines of `stderr` a user reads, without TensorFlow's start-up info lines."""
    return [line for line in stderr.strip().splitlines() if not _TENSORFLOW_STARTUP.match(line)]


def horovodrun(command, np=2, timeout=240, env=None, controller="--gloo"):
    """`horovodrun -np NP -H localhost:NP --gloo COMMAND` from the repository root; each rank forked from the
    test zygote where it can be."""
    return zygote.run(
        [HOROVODRUN, "-np", str(np), "-H", f"localhost:{np}", controller, *command],
        capture_output=True, text=True, timeout=patient(timeout), cwd=ROOT,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})},
    )


def free_port_block(count):
    """The first of `count` consecutive free ports, as `cluster.port_base` numbers a job's tasks."""
    return free_ports(count, consecutive=True)[0]


def tfdist_imports(script):
    """The tfdist modules a script imports (for an example that changed only its import line)."""
    with open(script) as f:
        tree = ast.parse(f.read())
    imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    imported += [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    return [name for name in imported if name.startswith("tfdist")]


def tfdist_command(*args):
    """`tfdist ARGS` run with this interpreter (works without the console script)."""
    return [sys.executable, "-m", "tfdist.cli", *args]


_TENSORFLOW_KEY_BASES = iter(range(100_000, 1_000_000, 1_000))  # below tfdist's own (1,000,000 per instance)


def tensorflow_mirrored(devices=("/cpu:0", "/cpu:1")):
    """TensorFlow's own MirroredStrategy, numbering its collectives apart from every other instance in the process.
    TensorFlow numbers every instance's from one start, so a second instance reuses the first's instance keys with
    other shapes and fails ("Shape mismatch in the collective instance 100"), with or without tfdist: in one test
    process, instances of many tests meet."""
    import tensorflow as tf

    apart = type("MirroredStrategy", (tf.distribute.MirroredStrategy,),
                 {"_collective_key_base": next(_TENSORFLOW_KEY_BASES)})
    return apart(list(devices))


def patient(seconds):
    """A time limit of the suite: `seconds` on the slowest machine kind CI uses, scaled by this machine's
    slowness against it (`machine_speed`), or under Bazel its test's own timeout if longer. `make test`
    runs Bazel beside pytest at the lowest CPU priority, where a process can take ten times its own
    time (in CI the activation scenario, 28 s alone, passed 300 s), and Bazel's --test_timeout ends
    a test that hangs."""
    return max(int(seconds * slowness()), int(os.environ.get("TEST_TIMEOUT", "0")))


def run_tfdist(*args, timeout=120, env=None):
    """Runs `tfdist ARGS` from the repository root (forked from the test zygote); returns the CompletedProcess."""
    return zygote.run(
        tfdist_command(*args),
        capture_output=True,
        text=True,
        timeout=patient(timeout),
        cwd=ROOT,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})},
    )


def launch_job(metrics, *flags, terminal=False, real_tasks=False):
    """`tfdist launch FLAGS --metrics_out METRICS`, forked from the test zygote with its tasks; with `terminal`,
    its stdout is a pseudo-terminal; with `real_tasks`, the launcher and its tasks are real processes (the
    launcher finds a task stopped by SIGSTOP among its own descendants, which a forked task is not)."""
    command = tfdist_command("launch", *flags, "--metrics_out", str(metrics))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = subprocess.Popen if real_tasks else zygote.Popen
    if not terminal:
        return start(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    reader, writer = pty.openpty()
    proc = start(command, cwd=ROOT, stdout=writer, stderr=subprocess.PIPE, text=True, env=env)
    os.close(writer)
    proc.terminal = reader
    return proc


def launch_output(proc, timeout=240):
    """(stdout, stderr) once the launcher has exited; a pseudo-terminal's end reads as EOF."""
    if hasattr(proc, "terminal"):
        out = b""
        while True:
            try:
                chunk = os.read(proc.terminal, 4096)
            except OSError:  # the pseudo-terminal's writer has gone
                break
            if not chunk:
                break
            out += chunk
        os.close(proc.terminal)
        out = out.decode(errors="replace")
    else:
        out = proc.stdout.read()
    err = proc.stderr.read()
    proc.wait(timeout=patient(timeout))
    return out, err


def read_until(proc, text):
    """Reads the launcher's stdout until `text` appears; returns what was read."""
    seen = ""
    while text not in seen:
        chunk = proc.stdout.readline()
        if not chunk:
            pytest.fail(f"the launcher ended before {text!r}: {seen[-2000:]} {proc.stderr.read()[-2000:]}")
        seen += chunk
    return seen


def launch_output_after(proc, text, act, timeout=60):
    """(stdout, stderr) of a launcher on which `act()` is done once `text` appears in its output;
    it is killed if it outlives that."""
    try:
        read_until(proc, text)
        act()
        return launch_output(proc, timeout=timeout)
    finally:
        proc.kill()


def train_with_metrics(tmp_path, config, *overrides, timeout=400):
    """`tfdist train --config CONFIG --set OVERRIDE ... --metrics_out`, asserted to succeed; (process, metrics)."""
    metrics = tmp_path / "metrics.json"
    args = ["train", "--config", config, "--metrics_out", str(metrics)]
    for override in overrides:
        args += ["--set", override]
    proc = run_tfdist(*args, timeout=timeout)
    assert proc.returncode == 0, why_it_failed(proc.stderr)
    return proc, json.loads(metrics.read_text())


def measure_in_fresh_process(module, kwargs, timeout=600):
    """`module.measure(**kwargs)`'s result, run in a process whose TensorFlow has not started (benchmarks
    fix its thread pools first), forked from the test zygote. `kwargs` is Python source, e.g. "dict(repeats=1)"."""
    script = f"import json; from {module} import measure; print(json.dumps(measure(**{kwargs})))"
    proc = zygote.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=patient(timeout), cwd=ROOT,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert proc.returncode == 0, why_it_failed(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ops_per_device(graph, types):
    """How many ops of `types` each device (`CPU:1`) runs in `graph` and the functions it calls."""
    from tfdist._compat import graph_functions

    ops = [op for g in (graph, *graph_functions(graph)) for op in g.get_operations()]
    devices = [op.device.split("device:")[-1] for op in ops if op.type in types]
    return dict(collections.Counter(d for d in devices if d))


def processes_with(marker):
    """PIDs of processes whose command line contains `marker` (each task's carries its --metrics_out)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return [pid for pid in found if pid != os.getpid()]


def task_pid(marker, variable, value):
    """The task process whose environment has VARIABLE=VALUE (a substring for TF_CONFIG)."""
    return _task_among(processes_with(marker), variable, value)


def horovod_rank_pid(horovodrun_pid, rank):
    """The PID of rank `rank`'s `tfdist train` below `horovodrun_pid`: only this job's, when other
    tests run Horovod jobs at the same time."""
    horovodrun_pid = zygote.forked_child(horovodrun_pid) or horovodrun_pid  # horovodrun forks from the zygote too
    return _task_among(descendants(horovodrun_pid), "HOROVOD_RANK", str(rank), exact=True)


def _task_among(pids, variable, value, exact=False):
    """The `tfdist train` process of `pids` (not a shell or the launcher's guard that runs it) whose
    environment's VARIABLE holds VALUE (or is it, `exact`): the zygote's child where the process found is
    its client, so that a signal, SIGSTOP too, reaches the task itself."""
    for pid in pids:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read()
        except OSError:
            continue
        found = env.get(variable.encode())
        if found is not None and (found == value.encode() if exact else value.encode() in found) \
                and b"tfdist.cli\0train\0" in command and b"tfdist.launch.guard" not in command:
            return zygote.forked_child(pid) or pid
    raise AssertionError(f"no task with {variable}={value} among {list(pids)}")


def tcp_bytes(payload: float, payload_back: float) -> float:
    """The most a link's counters should see one way for `payload` bytes of a step sent and `payload_back`
    received: each segment's 1448 bytes of data carry 66 of Ethernet, IP and TCP headers, each segment
    received is acknowledged by at most one 66-byte frame (every second one when idle; every one in
    TCP's quick-ack mode, which a busy receiver falls into), and a step's requests and their headers
    add a few KB (about 6 KB for a parameter-server worker)."""
    return payload * 1514 / 1448 + payload_back * 66 / 1448 + 6_000


def attention_and_mlp(features: int, optimizer=None):
    """A plain Keras model that `megatron_layout_map` splits: an input projection, a MultiHeadAttention block
    and a Dense MLP block on (6, features) inputs, 5 logits; compiled with `optimizer` if given."""
    import keras

    keras.utils.set_random_seed(1)
    inputs = keras.Input((6, features))
    x = keras.layers.Dense(16, name="embed")(inputs)
    h = keras.layers.MultiHeadAttention(num_heads=4, key_dim=8, name="attention")(x, x)
    h = keras.layers.LayerNormalization(name="norm")(h + x)
    m = keras.layers.Dense(32, activation="gelu", name="mlp_up")(h)
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h + keras.layers.Dense(16, name="mlp_down")(m))
    model = keras.Model(inputs, keras.layers.Dense(5, name="head")(h))
    if optimizer is not None:
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    return model


def megatron_layout_map(devices: int, data: int = 1):
    """Megatron's split as a Keras user writes it for JAX: the heads of a MultiHeadAttention named `attention`
    and the hidden units of an MLP of Dense `mlp_up` and `mlp_down` over the model axis."""
    import keras

    mesh = keras.distribution.DeviceMesh((data, devices), ("batch", "model"),
                                         devices=[f"cpu:{i}" for i in range(data * devices)])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["attention/(query|key|value)/kernel"] = (None, "model", None)
    layout_map["attention/(query|key|value)/bias"] = ("model", None)
    layout_map["attention/attention_output/kernel"] = ("model", None, None)
    layout_map["mlp_up/kernel"] = (None, "model")
    layout_map["mlp_up/bias"] = ("model",)
    layout_map["mlp_down/kernel"] = ("model", None)
    return layout_map
