"""The test zygote: a forked child behaves as the process it stands for."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import ROOT, free_ports, patient, processes_with
import zygote

# Two logical CPUs, one mirrored step (a collective all-reduce), the weights' sum; numpy's unseeded draw first.
_STEP = """
import json, sys
import numpy as np
unseeded = float(np.random.random())
import tfdist
strategy = tfdist.make_strategy(tfdist.load_config(None, ["strategy.logical_devices=2"]))
import keras
keras.utils.set_random_seed(int(sys.argv[1]))
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse")
model.fit(np.ones((8, 4), "float32"), np.zeros((8, 3), "float32"), batch_size=8, epochs=1, verbose=0)
print(json.dumps({"sum": float(sum(np.sum(w) for w in model.get_weights())), "replicas": strategy.num_replicas_in_sync,
                  "random": unseeded}))
"""

ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}


def _forked(args):
    """Whether `args` runs through the zygote (its client stands for the interpreter)."""
    return zygote.command(args)[1:4] == ["-I", "-S", zygote.CLIENT]


@pytest.mark.timeout(600)
def test_forked_children_train_as_fresh_processes_do_many_in_a_row():
    step = [sys.executable, "-c", _STEP, "3"]
    fresh = subprocess.run(step, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=patient(120))
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    expected = json.loads(fresh.stdout.splitlines()[-1])
    assert _forked(step)
    seen_random = set()
    for _ in range(20):
        done = zygote.run(step, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=patient(120))
        assert done.returncode == 0, done.stderr[-2000:]
        result = json.loads(done.stdout.splitlines()[-1])
        assert result["sum"] == expected["sum"] and result["replicas"] == 2
        seen_random.add(result["random"])
    assert len(seen_random) == 20  # numpy's unseeded generator differs from child to child, as from process to process
    assert done.stderr == ""  # not even TensorFlow's start-up lines


def _state(pid):
    """A process's state letter (T: stopped), read when it has settled."""
    time.sleep(0.5)
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.timeout(300)
def test_a_child_is_signalled_killed_and_fails_as_the_process_would():
    code = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(7)); print('up', flush=True); " \
           "time.sleep(600)"
    marker = f"zygote-test-{os.getpid()}"
    sleeper = zygote.Popen([sys.executable, "-c", code, marker], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, text=True)
    assert sleeper.stdout.readline() == "up\n"
    assert processes_with(marker) == [sleeper.pid]  # the client, whose command line is the command's
    sleeper.terminate()  # passed on to the child, whose handler exits 7
    assert sleeper.wait(timeout=patient(30)) == 7
    sleeper = zygote.Popen([sys.executable, "-c", code, marker], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, text=True)
    assert sleeper.stdout.readline() == "up\n"
    sleeper.kill()  # the client: the zygote kills its child
    assert sleeper.wait(timeout=patient(30)) == -signal.SIGKILL
    assert sleeper.stdout.read() == ""  # every writer of the pipe has gone: the child too
    sleeper = zygote.Popen([sys.executable, "-c", code, marker], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, text=True)
    assert sleeper.stdout.readline() == "up\n"
    child = zygote.forked_child(sleeper.pid)
    assert child not in (None, sleeper.pid), zygote.refusals()
    zygote.send_signal(sleeper, signal.SIGSTOP)  # the child itself stops
    assert _state(child) == "T" and _state(sleeper.pid) != "T"
    zygote.send_signal(sleeper, signal.SIGKILL)
    assert sleeper.wait(timeout=patient(30)) == -signal.SIGKILL and zygote.forked_child(sleeper.pid) is None
    failed = zygote.run([sys.executable, "-c", "import sys; print('out'); sys.exit('why')"], cwd=ROOT, env=ENV,
                        capture_output=True, text=True, timeout=patient(60))
    assert (failed.returncode, failed.stdout, failed.stderr) == (1, "out\n", "why\n")
    raised = zygote.run([sys.executable, "-c", "raise KeyError('k')"], cwd=ROOT, env=ENV, capture_output=True,
                        text=True, timeout=patient(60))
    assert raised.returncode == 1 and raised.stderr.rstrip().endswith("KeyError: 'k'")
    killed_self = zygote.run([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
                             cwd=ROOT, env=ENV, timeout=patient(60))
    assert killed_self.returncode == -signal.SIGKILL


def _parent(args, **kwargs):
    """The pid of the process that started `python ARGS` (run through the zygote where it can be)."""
    code = "import os; print(os.getppid())"
    done = zygote.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=patient(120),
                      **kwargs)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout)


def _environment(pid):
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(item.decode().split("=", 1) for item in f.read().split(b"\0") if b"=" in item)


@pytest.mark.timeout(300)
def test_other_import_time_values_fork_from_a_sibling_and_what_none_can_stand_in_for_runs_for_real():
    the_zygote = _parent([], env=ENV)
    assert the_zygote != os.getpid()
    other_kernels = "1" if ENV.get("TF_ENABLE_ONEDNN_OPTS") == "0" else "0"  # read at import
    with_other_kernels = {**ENV, "TF_ENABLE_ONEDNN_OPTS": other_kernels}
    sibling = _parent([], env=with_other_kernels)
    assert sibling not in (os.getpid(), the_zygote)
    assert _environment(sibling)["TF_ENABLE_ONEDNN_OPTS"] == other_kernels
    assert _parent([], env=with_other_kernels) == sibling  # one sibling for those values
    other = _parent([], env={**ENV, "PYTHONPATH": "/nowhere"})
    assert other not in (the_zygote, sibling)  # a sibling of its own; past MAX_SIBLINGS the real interpreter
    if other == os.getpid():
        assert "no sibling zygote has them" in zygote.refusals()[-1]
    # tfdist's command line chooses its log level before TensorFlow loads where the environment leaves it unset.
    unset = {k: v for k, v in ENV.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    assert zygote._values_at_import({"env": unset, "argv": ["-m", "tfdist.cli", "train"]})["TF_CPP_MIN_LOG_LEVEL"] == "3"
    assert zygote._values_at_import({"env": unset, "argv": ["-c", "pass"]})["TF_CPP_MIN_LOG_LEVEL"] is None
    assert not _forked([sys.executable, "-X", "importtime", "-c", "pass"])  # interpreter options
    assert not _forked(["/bin/echo", "x"])


_STARTS_PYTHON = """
import json, subprocess, sys
from tfdist.bench.jobs import on_core
report = "import json, os; print(json.dumps([os.getppid(), sorted(os.sched_getaffinity(0)), os.getpriority(os.PRIO_PROCESS, 0)]))"
started = {}
for name, command in (("module", ["nice", "-n", "7", *on_core(1), sys.executable, "-m", "report"]),
                      ("snippet", [sys.executable, "-c", report])):
    done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=sys.argv[1])
    started[name] = json.loads(done.stdout)
print(json.dumps(started))
"""


@pytest.mark.timeout(300)
def test_a_childs_python_processes_fork_from_the_zygote_pinned_and_niced_as_started(tmp_path):
    """A benchmark pins its jobs (`on_core`) and may nice them; a launcher's tasks are `python -m`, a local
    cluster's servers `python -c`."""
    (tmp_path / "report.py").write_text("import json, os; print(json.dumps([os.getppid(), "
                                        "sorted(os.sched_getaffinity(0)), os.getpriority(os.PRIO_PROCESS, 0)]))")
    done = zygote.run([sys.executable, "-c", _STARTS_PYTHON, str(tmp_path)], cwd=ROOT, env=ENV, capture_output=True,
                      text=True, timeout=patient(120))
    assert done.returncode == 0, done.stderr[-3000:]
    started = json.loads(done.stdout)
    the_zygote = _parent([], env=ENV)
    assert started["module"] == [the_zygote, [1], 7]
    assert started["snippet"][0] == the_zygote  # `python -c` too (tfdist's local servers are snippets)


@pytest.mark.timeout(120)
def test_a_child_ends_as_the_interpreter_does():
    code = ("import atexit, sys, threading, time; atexit.register(lambda: print('atexit', flush=True)); "
            "threading.Thread(target=lambda: (time.sleep(1), print('thread'))).start(); print('main', end='')")
    done = zygote.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=patient(60))
    assert (done.returncode, done.stdout) == (0, "mainthread\natexit\n")  # joined, handlers run, flushed
    done = zygote.run([sys.executable, "-c", "raise KeyboardInterrupt"], env=ENV, capture_output=True, text=True,
                      timeout=patient(60))
    assert done.returncode == -signal.SIGINT and "KeyboardInterrupt" in done.stderr
    done = zygote.run([sys.executable, "-c", "import sys; sys.exit(300)"], env=ENV, timeout=patient(60))
    assert done.returncode == 300 & 0xFF


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_forked_children_are_the_workers_of_one_multi_worker_job(tmp_path):
    """Each child starts its own TensorFlow runtime and gRPC server after the fork."""
    ports = free_ports(2)
    workers = ", ".join(f"127.0.0.1:{p}" for p in ports)
    procs = [zygote.Popen([sys.executable, "-m", "tfdist.cli", "train", "--set", "strategy.kind=multi_worker_mirrored",
                           "--set", f"cluster.workers=[{workers}]", "--set", f"cluster.task_index={index}",
                           "--set", "train.epochs=1", "--set", "train.steps_per_epoch=5", "--set", "train.verbose=0",
                           "--metrics_out", str(tmp_path / f"m{index}.json")],
                          cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for index in range(2)]
    for proc in procs:
        _, err = proc.communicate(timeout=patient(240))
        assert proc.returncode == 0, err[-3000:]
    assert json.loads((tmp_path / "m0.json").read_text())["num_replicas"] == 2  # the chief's report


def test_the_oracle_answers_from_keras_alone_and_knows_no_tfdist(tmp_path):
    """`oracle.keras_alone` trains a saved Keras model as Keras does; a model that needs tfdist to load fails there,
    as it would in a process that never imported it."""
    import keras
    import numpy as np
    from oracle import keras_alone

    from tfdist.layers import ColumnParallelDense

    x, y = np.ones((8, 4), "float32"), np.zeros((8, 3), "float32")
    for name, layer in (("plain", keras.layers.Dense(3)), ("tfdist", ColumnParallelDense(3))):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), layer])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.save(tmp_path / f"{name}.keras")
    start = model.get_weights()
    trained = keras_alone("fit", str(tmp_path / "plain.keras"), x, y, batch_size=8, epochs=2)
    assert trained["iterations"] == 2 and len(trained["history"]["loss"]) == 2
    assert not np.allclose(trained["weights"][0], start[0])
    with pytest.raises(AssertionError, match="(?s)the reference fit failed: .*locate class 'ColumnParallelDense'"):
        keras_alone("fit", str(tmp_path / "tfdist.keras"), x, y, batch_size=8)
