"""keras-hub LLMs (Gemma, Llama 3, Mistral) fine-tuned with LoRA under tfdist's memory options (ZeRO 1 and 2, ZeRO 3
with rematerialization, the backbone's own layout map, a pipeline of 2 stages) in float32 and mixed_bfloat16, against
Keras alone on one device in a process that never imported tfdist: the weights (float32) or the loss
(mixed_bfloat16), greedy generation, the frozen weights, the optimizer's state and the LoRA file
(tests/scenarios/fine_tune_matrix.py trains them); and a run killed by SIGKILL resumes exactly
(tests/scenarios/fine_tune_resume.py)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import zygote
from helpers import ROOT, SCENARIO_DIR, patient, why_it_failed

SCRIPT = os.path.join(SCENARIO_DIR, "fine_tune_matrix.py")
KINDS = ["shard_optimizer 1", "shard_optimizer 2", "shard_optimizer 3, remat", "layout 1x2", "pipeline 2 stages"]
BACKBONES = ["gemma", "llama3", "mistral"]
# float32: each replica's half of the batch summed in another order than one device's whole, then Adam's 4 steps of
# lr 1e-2 on LoRA factors: float32 epsilon x 8 rows x 4 steps x Adam's normalised step 1e-2 = 4e-8 per step's
# gradient, amplified by Adam where a second moment is small; measured 3.1e-7 at most, bound 2e-6.
FLOAT32_TOLERANCE = 2e-6
# mixed_bfloat16: the loss is computed from bfloat16 logits, each good to bfloat16's 2^-8 of itself, so two runs'
# losses agree to 2^-8 of the loss (measured: 1.2e-3 of 4.56 without oneDNN, the layout's Gemma). Their weights
# are not compared: Adam normalises each step, so where a gradient is near 0 bfloat16's rounding of other partial
# sums (another split of the batch, or of a matmul) flips the step's sign, and two bfloat16 runs' weights differ by
# up to a step (measured 0.037, 3.7 times the learning rate), which a broken run could match as well.
BFLOAT16_RELATIVE = 2 ** -8


def _run(out, *flags, env):
    return zygote.Popen([sys.executable, SCRIPT, str(out), *flags], cwd=ROOT, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True, env=env)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """kind ("keras" for the reference) -> "backbone|precision" -> what the cell did; both processes side by side."""
    out = tmp_path_factory.mktemp("fine_tune_matrix")
    procs = [_run(out / "keras.json", env={**os.environ, zygote.WITHOUT_TFDIST_VARIABLE: "1"}),
             _run(out / "kinds.json", "--kinds", env=dict(os.environ))]
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=patient(420))
            assert proc.returncode == 0, why_it_failed(err)
    finally:
        for proc in procs:
            proc.kill()
    return {**json.loads((out / "keras.json").read_text()), **json.loads((out / "kinds.json").read_text())}


def _distances(weights, others) -> list:
    return [float(np.abs(np.subtract(a, b)).max()) for a, b in zip(weights, others)]


# Its reference forks from the zygote without tfdist that the other tests of such references use.
@pytest.mark.xdist_group("without_tfdist")
@pytest.mark.timeout(900)  # the first test's: the fixture's processes
@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize("kind", KINDS)
def test_lora_fine_tuning_under_a_memory_option_trains_and_generates_as_on_one_device(trained, kind, backbone):
    for precision in ("float32", "mixed_bfloat16"):
        reference, result = trained["keras"][f"{backbone}|{precision}"], trained[kind][f"{backbone}|{precision}"]
        assert "weights" in reference, reference
        if result.get("no_layout_map"):
            assert (kind, backbone) == ("layout 1x2", "mistral")  # keras-hub 0.32 gives Mistral none
            continue
        assert "weights" in result, (precision, result)
        # Only the LoRA factors train and hold Adam's two slots; the frozen weights end as they began.
        assert result["lora_weights"] == result["trainable_weights"] == 4  # query and value, a and b
        assert result["slots_per_lora_weight"] == 2 and result["frozen_unchanged"] is True
        distances = _distances(result["weights"], reference["weights"])
        if precision == "float32":
            assert max(distances) <= FLOAT32_TOLERANCE, distances
            assert result["lora_file_loads_on_one_device"] is True
            # Loaded on one device, its LoRA weights generate the reference's tokens (exact: greedy choices of
            # logits that differ by float32 rounding).
            assert result["generated_on_one_device"] == reference["generated"]
        else:
            np.testing.assert_allclose(result["loss"], reference["loss"], rtol=BFLOAT16_RELATIVE)
        if precision == "float32":  # a layout's model generates on its whole weights, gathered
            assert result["generated"] == reference["generated"]


RESUME = os.path.join(SCENARIO_DIR, "fine_tune_resume.py")


def _resume_run(checkpoints, out, *flags):
    return zygote.run([sys.executable, RESUME, str(checkpoints), str(out), *flags], cwd=ROOT, capture_output=True,
                      text=True, timeout=patient(300))


# With remat and ZeRO stage 3, the LoRA factors split: None, a Gemma under MirroredStrategy in float32; a backbone,
# under its own layout map on a 2 x 2 mesh in mixed_bfloat16.
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", [None, "gemma", "llama3"])
def test_lora_fine_tuning_under_zero_3_and_remat_killed_by_sigkill_resumes_exactly_and_generates_as_one_device(
        tmp_path, layout):
    flags = ["--layout", layout] if layout else []
    whole = _resume_run(tmp_path / "whole", tmp_path / "whole.npz", *flags)
    assert whole.returncode == 0, why_it_failed(whole.stderr)
    killed = _resume_run(tmp_path / "killed", tmp_path / "never.npz", "--sigkill-after", "6", *flags)
    assert killed.returncode == -9 and not (tmp_path / "never.npz").exists()  # mid-epoch 2, its step saved
    resumed = _resume_run(tmp_path / "killed", tmp_path / "resumed.npz", *flags)
    assert resumed.returncode == 0, why_it_failed(resumed.stderr)
    with np.load(tmp_path / "whole.npz") as want, np.load(tmp_path / "resumed.npz") as got:
        for key in want.files:  # the weights and, under a layout, what the model generated
            # exact: the same steps from the same restored bytes, with the same kernels on the same shapes
            np.testing.assert_array_equal(got[key], want[key])
        if layout:
            # exact: the split model generates on its whole weights, gathered, as one device does with them
            assert got["generated"].tolist() == got["generated_on_one_device"].tolist()
            assert got["generated_from_lora_file"].tolist() == got["generated"].tolist()
            assert got["lora_file_loads"]
