"""`tfdist.horovod.tensorflow`: Horovod's custom-loop surface on Keras 3, and Horovod's kinds of example
scripts with only their import line changed, under horovodrun."""

import json
import os
import sys

import numpy as np
import pytest
import zygote

from helpers import ROOT, SCENARIO_DIR, horovodrun, patient, run_tfdist, tfdist_imports, why_it_failed

pytestmark = [pytest.mark.horovod, pytest.mark.multiprocess, pytest.mark.timeout(300)]

CUSTOM_LOOP = os.path.join(SCENARIO_DIR, "horovod_custom_loop.py")
MODES = ["plain", "seed_by_rank", "partial", "tape_options", "optimizer"]


@pytest.fixture(scope="module")
def loops(tmp_path_factory):
    """Every mode of the custom loop, trained in one 2-rank job, and the plain loop in one process (the
    reference): {"plain": [rank 0's results, rank 1's], ..., "reference": [the one process's]}."""
    out = str(tmp_path_factory.mktemp("custom_loop") / "loop")
    results = {}
    for np_, modes in ((2, MODES), (1, ["plain"])):
        done = horovodrun([sys.executable, CUSTOM_LOOP, f"{out}{np_}", *modes], np=np_)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        for mode in modes:
            ranks = [np_load(f"{out}{np_}.{mode}.rank{r}.npz") for r in range(np_)]
            results[mode if np_ == 2 else "reference"] = ranks
    return results


# The tests of the custom loop run on one pytest worker, so the jobs run once, within the first one's time.
on_one_worker = pytest.mark.xdist_group("horovod_custom_loop")


def np_load(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def _weights(result):
    return [result[k] for k in sorted((k for k in result if k.startswith("arr_")), key=lambda k: int(k[4:]))]


@on_one_worker
@pytest.mark.timeout(420)
def test_a_custom_loop_matches_one_process_on_the_whole_batches(loops):
    ranks, (reference,) = loops["plain"], loops["reference"]
    assert ranks[0]["checksum"] == ranks[1]["checksum"]  # every rank ends with the same weights
    for a, b in zip(_weights(ranks[0]), _weights(reference)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    # Horovod's own tensor functions, on each rank:
    for result in ranks:
        np.testing.assert_array_equal(result["allgather"], [0, 1])  # exact: integers, as below
        np.testing.assert_array_equal(result["broadcast"], [0, 0])  # exact: integers
        np.testing.assert_array_equal(result["alltoall"], [0, 1])  # exact: element r of every rank goes to rank r
        np.testing.assert_array_equal(result["allreduce"], [1, 1])  # exact: integers
        assert int(result["join"]) in (0, 1)  # the last rank to join


@on_one_worker
@pytest.mark.timeout(420)
@pytest.mark.parametrize("mode,tolerance", [("tape_options", 1e-3), ("optimizer", 1e-5)])
def test_tape_options_and_the_distributed_optimizer_match_one_process(loops, mode, tolerance):
    ranks, (reference,) = loops[mode], loops["reference"]
    assert ranks[0]["checksum"] == ranks[1]["checksum"]
    for a, b in zip(_weights(ranks[0]), _weights(reference)):  # fp16 compression: to 1e-3
        np.testing.assert_allclose(a, b, atol=tolerance, rtol=0)


@on_one_worker
@pytest.mark.timeout(420)
def test_broadcast_variables_makes_ranks_that_started_apart_equal(loops):
    ranks = loops["seed_by_rank"]
    assert ranks[0]["checksum"] == ranks[1]["checksum"]


@on_one_worker
@pytest.mark.timeout(420)
def test_a_partial_tape_keeps_the_local_layers_gradients_on_their_rank(loops):
    ranks = loops["partial"]
    first, second = _weights(ranks[0]), _weights(ranks[1])
    # The hidden layer's gradients are all-reduced: equal on both ranks; the head's are each rank's own.
    # exact: both ranks apply the same all-reduced gradients to the same weights with the same kernels
    np.testing.assert_array_equal(first[0], second[0])
    np.testing.assert_array_equal(first[1], second[1])  # exact: as above
    assert np.abs(first[2] - second[2]).max() > 1e-4


SURFACE = os.path.join(SCENARIO_DIR, "horovod_port_surface.py")


@pytest.fixture(scope="module")
def surface(tmp_path_factory):
    """What the port's own names did on each rank of one 2-rank job ([rank 0's, rank 1's], each its JSON and the
    weights it trained with SyncBatchNormalization), and the reference weights from BatchNormalization on the global
    batches in a process that never imported tfdist or Horovod."""
    out = str(tmp_path_factory.mktemp("surface") / "out")
    done = horovodrun([sys.executable, SURFACE, out])
    assert done.returncode == 0, why_it_failed(done.stdout + done.stderr)
    reference = zygote.run([sys.executable, SURFACE, out, "--reference"], capture_output=True, text=True, cwd=ROOT,
                           timeout=patient(120), env={**os.environ, zygote.WITHOUT_TFDIST_VARIABLE: "1"})
    assert reference.returncode == 0, why_it_failed(reference.stderr)
    ranks = [(json.load(open(f"{out}.rank{rank}.json")), _weights(np_load(f"{out}.rank{rank}.npz")))
             for rank in range(2)]
    return ranks, _weights(np_load(f"{out}.reference.npz"))


# Its reference forks from the zygote without tfdist that the other tests of such references use.
on_the_worker_without_tfdist = pytest.mark.xdist_group("without_tfdist")


@on_the_worker_without_tfdist
def test_sync_batch_normalization_on_uneven_shares_trains_as_batch_normalization_on_the_global_batch(surface):
    (_, first), (_, second), reference = *surface[0], surface[1]
    for mine, theirs in zip(first, second):
        np.testing.assert_array_equal(mine, theirs)  # exact: the ranks apply the same summed gradients
    # Each rank's sums of 16 and 8 rows added by the all-reduce, and the variance as E[x^2] - E[x]^2, against one
    # process's sums of 24: float32 epsilon x 24 rows = 2.9e-6 of the largest value of a weight (measured: 3.5e-7 of
    # the moving variance's 65, 7e-8 of the moving mean's 5.8).
    # The first layer's bias feeds the normalization, which subtracts it again: its gradient is 0 but for rounding,
    # so both runs leave it at rounding noise (measured: 7e-8 at most), not equal.
    bias_before = 1
    assert np.abs(first[bias_before]).max() < 1e-6 and np.abs(reference[bias_before]).max() < 1e-6
    for index, (mine, theirs) in enumerate(zip(first, reference)):
        if index != bias_before:
            np.testing.assert_allclose(mine, theirs, rtol=0, atol=2.9e-6 * np.abs(theirs).max())


@on_the_worker_without_tfdist
def test_the_ports_own_names_do_what_horovods_do_on_keras_3_variables(surface):
    for rank, (found, _) in enumerate(surface[0]):
        assert found["ops"] == [rank, rank, 2, 2, 1] and found["ops_eagerly"] == [rank, 2]
        assert found["built"] == {"mpi": True, "gloo": True, "nccl": 0, "cuda": False}  # tools/install_horovod.sh
        assert found["is_homogeneous"] is True
        # In place, into the same variable, as Horovod's own does to a tf.Variable.
        assert found["broadcast_"] == {"port": [2.0] * 3, "horovod": [2.0] * 3, "same_variable": True}
        # Horovod Keras's collectives on a Keras 3 variable in a tf.function, as horovod.tensorflow's on a tensor
        # (exact: the same collectives on the same numbers).
        assert found["keras_collectives"] == found["horovod_collectives"]
        assert found["keras_collectives"]["reducescatter"] == [[5.0, 6.0], [7.0, 8.0]][rank]  # averaged by default
        assert found["elastic_restored"] == [[5.0, 6.0], [3.0]]  # the committed values
        assert found["elastic_synced"] == [[10.0, 0.0], 0]  # rank 0's variables and its committed epoch
        assert found["elastic_without_variables"].startswith("TensorFlowState needs its variables")
        assert [line.split(";")[0] for line in found["broadcast_global_variables"]] == [
            "broadcast_global_variables: TensorFlow 2 has no global variables"] * 2
        best = found["best_model_checkpoint"]
        assert best["written"] == best["best"] and best["best"] == [0, 1]  # val_loss falls, then rises
        assert best["loaded"] == best["kernels"][best["best"][-1]]  # exact: the file holds that epoch's kernel
        assert best["without_path"].startswith("BestModelCheckpoint has no path to save to")


def _example(name):
    return os.path.join(ROOT, "examples", name)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_custom_loop_script_trains_digits_with_only_its_import_changed_under_tfdist_launch(tmp_path):
    script = _example("horovod_tensorflow_digits.py")
    assert tfdist_imports(script) == ["tfdist.horovod.tensorflow", "tfdist.data"]  # the data: tfdist ships it
    # Under tfdist's launcher (which runs horovodrun); bounded only against a hang: a busy machine once took
    # longer than 240 s for 300 steps a rank.
    done = run_tfdist("launch", "--workers", "2", "--set", "strategy.kind=horovod", "--", sys.executable, script,
                      "--checkpoint_dir", str(tmp_path), "--result", str(tmp_path / "accuracy.txt"), timeout=540)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert float((tmp_path / "accuracy.txt").read_text()) >= 0.95
    # Local rank 0 logs; the launcher shows rank 0's output as it is and prefixes the others'.
    assert "\nStep #250" in done.stdout and "[rank 1] Step" not in done.stdout
    assert (tmp_path / "checkpoint").exists()  # rank 0 saved


@pytest.mark.slow
@pytest.mark.parametrize("name,module", [
    ("horovod_synthetic_benchmark.py", "tfdist.horovod.tensorflow"),
    ("horovod_keras_synthetic_benchmark.py", "tfdist.horovod.tensorflow.keras"),
])
def test_the_synthetic_benchmarks_run_a_keras_applications_model(tmp_path, name, module):
    script = _example(name)
    assert tfdist_imports(script) == [module]
    # MobileNet (v1): 91 layers and 83 weights to trace, where MobileNetV2's 156 and 158 took 121 CPU-seconds on the
    # AVX2 EPYC (the custom loop traces its step twice, as Horovod's script does: the first batch and the rest).
    done = horovodrun([sys.executable, script, "--model", "MobileNet", "--image_size", "32", "--batch_size", "8",
                       "--num_warmup_batches", "1", "--num_batches_per_iter", "2", "--num_iters", "3",
                       "--result", str(tmp_path / "result.json")])
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["ranks"] == 2 and result["images_per_sec_per_rank"] > 0
    assert done.stdout.count("img/sec per rank") == 3 and "Total img/sec on 2 rank(s)" in done.stdout


def test_the_old_module_name_is_the_same_module_and_says_it_is_deprecated():
    import tfdist.horovod.tensorflow.keras as keras_surface

    sys.modules.pop("tfdist.horovod_keras", None)
    with pytest.warns(DeprecationWarning, match="import tfdist.horovod.tensorflow.keras instead"):
        import tfdist.horovod_keras as old
    from tfdist.horovod_keras import callbacks

    assert old is keras_surface and callbacks is keras_surface.callbacks
