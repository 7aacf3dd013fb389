"""The scripts of Keras's and TensorFlow's guides in examples/, their strategy line changed to tfdist's: each run
under a kind equals its one-device run with the same global batch, and what it saves restores. The cells these
tests fill are tests/own_script_cells.py's; tools/own_script_table.py writes docs/own-script.md's tables from a
run's results."""

import os
import re
import sys

import numpy as np
import pytest

from helpers import ROOT, patient, why_it_failed
import zygote

pytestmark = pytest.mark.timeout(600)

from own_script_cells import HOSTS, JOBS, KINDS, LAUNCHED, MATRIX, PARAMETER_SERVERS, REFUSED_CUSTOM_LOOP

# With tests/launch/test_hosts.py, which checks that no job leaves a host behind.
_ON_NAMESPACE_HOSTS = [pytest.mark.xdist_group("namespace_hosts"),
                       pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces and tc need root")]

def _script(name, sets, *args, job=None, succeeds=True):
    """Runs the example `name` with `--set` for each of `sets`; under `tfdist launch` as `job` (of `JOBS`)."""
    command = [sys.executable, os.path.join(ROOT, "examples", name), *(f"--set={s}" for s in sets), *map(str, args)]
    if job is not None:
        tasks, kind, _ = JOBS[job]
        command = [sys.executable, "-m", "tfdist.cli", "launch", *tasks, "--set", kind, "--", *command]
    proc = zygote.run(command, capture_output=True, text=True, timeout=patient(300), cwd=ROOT,
                      env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert (proc.returncode == 0) == succeeds, why_it_failed(proc.stderr)
    return proc


def _processes(job) -> int:
    """How many processes run the script: one, or those of `job` (of `JOBS`)."""
    return JOBS[job][2] if job else 1


def _assert_equal_weights(expected, got):
    """Every variable of the one-device run within 1e-5 in `got`."""
    assert expected.keys() == got.keys() and len(expected) >= 6
    for key, value in expected.items():
        np.testing.assert_allclose(got[key], value, atol=1e-5, err_msg=key)


def _keras_distributed(directory, sets, replicas, job=None):
    """Keras's guide: fit inside the scope, evaluate, ModelCheckpoint and load_model under a new strategy; the
    final weights, and whether every checkpoint loaded and the last predicts as the model (in every process)."""
    del replicas  # the guide's batch is global
    proc = _script("guide_keras_distributed.py", sets, "--checkpoint_dir", directory / "checkpoints",
                   "--weights_out", directory / "weights.npz", job=job)
    processes = _processes(job)
    assert proc.stdout.count("Restoring from") == processes, proc.stdout
    assert proc.stdout.count(" loads: predictions (64, 10)") == 2 * processes, proc.stdout
    # The trained model predicts under its strategy, the reloaded one on one device: a replica's kernels see its
    # share of the 64 rows and a split model sums its shards' products, so each logit's sums of 64 products may round
    # in another order (Eigen's matmul blocks by shape; oneDNN happened not to). Bound: float32's epsilon (1.2e-7)
    # times the sums' length (64) times the logits' scale (about 1) is 7.6e-6; measured 1.7e-6 on the AVX2 EPYC.
    tolerance = 1e-5
    differences = re.findall(r"the last checkpoint predicts as the trained model: max difference (\S+)", proc.stdout)
    assert len(differences) == processes and all(float(d) <= tolerance for d in differences), proc.stdout
    weights = np.load(directory / "weights.npz")
    return {key: weights[key] for key in weights}, proc.stderr


def _custom_training_loop(directory, sets, replicas, job=None):
    """TensorFlow's custom-loop guide: its optimizer built by the first step inside `strategy.run` in a
    `tf.function` (keras-team/keras#19246 failed there); the checkpoint's variables, restored without a strategy
    (in every process: the others restore their own scratch copies)."""
    import tensorflow as tf

    proc = _script("guide_custom_training_loop.py", sets, "--batch_per_replica", 128 // replicas, "--epochs", 1,
                   "--checkpoint_dir", directory, job=job)
    scores = re.findall(r"without strategy: (\S+) \(trained: (\S+)\)", proc.stdout)
    assert len(scores) == _processes(job) and all(a == b for a, b in scores), proc.stdout
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(directory)))
    return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map() if k.endswith("VARIABLE_VALUE")}, \
        proc.stderr


def _multi_worker_keras(directory, sets, replicas, job=None):
    """TensorFlow's multi-worker Keras guide: `fit` with BackupAndRestore, then the chief's save (the others save a
    scratch copy they delete); the saved model's weights, and nothing else left behind (the backup is deleted)."""
    import keras

    proc = _script("guide_multi_worker_keras.py", sets, "--epochs", 2, "--steps_per_epoch", 5,
                   "--per_worker_batch", 128 // replicas, "--model_path", directory / "model.keras",
                   "--backup_dir", directory / "backup", job=job)
    assert os.listdir(directory) == ["model.keras"]
    return {w.path: w.numpy() for w in keras.models.load_model(directory / "model.keras").weights}, proc.stderr


def _parameter_server_guide(directory, sets, replicas, job=None):
    """TensorFlow's parameter-server guide: `fit` on a dataset function's dataset, then its custom loop (under
    parameter servers of `ClusterCoordinator.schedule` steps, elsewhere of `strategy.run` steps); both parts'
    weights. Launched, the chief runs it and the other tasks serve."""
    del replicas  # the guide's batch is global
    proc = _script("guide_parameter_server.py", sets, "--weights_out", directory / "weights.npz", job=job)
    assert proc.stdout.count("Finished epoch 1, accuracy is") == _processes(job), proc.stdout
    weights = {part: np.load(directory / f"weights-{part}.npz") for part in ("fit", "custom_loop")}
    return {f"{part}/{key}": arrays[key] for part, arrays in weights.items() for key in arrays}, proc.stderr


RUN = {"guide_keras_distributed.py": _keras_distributed, "guide_custom_training_loop.py": _custom_training_loop,
       "guide_multi_worker_keras.py": _multi_worker_keras, "guide_parameter_server.py": _parameter_server_guide}


_ONE_DEVICE: dict = {}  # guide -> its one-device run's weights, run once per test process


def _one_device(guide, tmp_path_factory):
    if guide not in _ONE_DEVICE:
        _ONE_DEVICE[guide] = RUN[guide](tmp_path_factory.mktemp("one-device"), ["strategy.kind=one_device"], 1)[0]
    return _ONE_DEVICE[guide]


@pytest.mark.slow
@pytest.mark.parametrize("guide,kind", [(g, k) for g, row in MATRIX.items() for k in row])
def test_a_guide_script_under_a_kind_equals_one_device(tmp_path_factory, guide, kind):
    if MATRIX[guide][kind] == REFUSED_CUSTOM_LOOP:
        proc = _script(guide, KINDS[kind], succeeds=False)
        assert "trains a model split over 2 devices with Keras's fit (or train_on_batch) in this version, not in " \
               "a custom training loop" in proc.stderr, why_it_failed(proc.stderr)
        return
    expected = _one_device(guide, tmp_path_factory)
    replicas = 2 if kind.startswith("mirrored") or kind == "tensor_parallel" else 1  # num_replicas_in_sync
    got, stderr = RUN[guide](tmp_path_factory.mktemp(f"{guide}-{kind}".replace(" ", "").replace(",", "-")),
                             KINDS[kind], replicas)
    _assert_equal_weights(expected, got)
    unpipelined = "runs a step of your own whole on each replica's first device, not in stages" in stderr
    assert unpipelined == ("not pipelined" in MATRIX[guide][kind]), stderr[-2000:]
    unsplit = "first applied in a custom loop, keeps a whole copy on every device" in stderr
    assert unsplit == ("not split" in MATRIX[guide][kind]), stderr[-2000:]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("guide,job", [
    pytest.param(g, j, marks=_ON_NAMESPACE_HOSTS if j == HOSTS else ())
    for g, row in LAUNCHED.items() for j, (says, test) in row.items() if test is None])
def test_a_guide_script_launched_as_several_processes_equals_one_device(tmp_path_factory, guide, job):
    """The chief's saves are waited for by every process (Keras's guide restores as soon as `fit` returns), and
    only the chief's files are the job's: each is compared with the one-device run's."""
    expected = _one_device(guide, tmp_path_factory)
    got, _ = RUN[guide](tmp_path_factory.mktemp(f"{guide}-{job.split('(')[1][:-1]}"), [JOBS[job][1]], JOBS[job][2],
                        job=job)
    _assert_equal_weights(expected, got)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_custom_loop_called_on_the_parameter_servers_chief_is_refused_in_one_line(tmp_path):
    """`strategy.run` outside `ClusterCoordinator.schedule` would train on the chief alone, the workers idle."""
    proc = _script("guide_custom_training_loop.py", [JOBS[PARAMETER_SERVERS][1]], "--checkpoint_dir", tmp_path,
                   job=PARAMETER_SERVERS, succeeds=False)
    assert "NotImplementedError: tfdist: parameter servers: strategy.run(train_step) was called on the chief, where " \
           "it would train on the chief instead of the workers; schedule the step onto them with " \
           "strategy.coordinator.schedule(" in proc.stderr, proc.stderr[-3000:]
    assert "tfdist launch: error: chief 0 failed (exit code 1)" in proc.stderr
    assert not os.listdir(tmp_path)  # nothing trained, nothing saved


def test_the_pages_tables_are_what_a_run_of_every_passing_cell_writes():
    """`make test` checks the page against its own run's results (tools/own_script_table.py --check); this checks
    the page and the cells' definitions against each other at once."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import own_script_table
    from own_script_cells import kind_cells, launched_cells

    every_cell_passed = {test: "passed" for *_, test in kind_cells() + launched_cells()}
    page = open(own_script_table.PAGE, encoding="utf-8").read()
    assert own_script_table.render_page(page, every_cell_passed) == page
