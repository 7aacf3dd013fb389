"""tfdist is a guest in Keras's house: plain Keras programs leave the same weights, traced ops, files and errors in
a process where a tfdist strategy was made as in one that never imported tfdist."""

import json
import os
import sys

import pytest
import zygote
from helpers import ROOT, patient, why_it_failed

from tfdist._compat.patches import patches

SCRIPT = os.path.join(ROOT, "tests", "scenarios", "plain_keras_programs.py")


def _programs(out_dir, *flags, env):
    targets = json.dumps([patch.target for patch in patches()])
    proc = zygote.run([sys.executable, SCRIPT, str(out_dir), targets, *flags], capture_output=True, text=True,
                      timeout=patient(300), cwd=ROOT, env=env)
    assert proc.returncode == 0, why_it_failed(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


# On one worker with the other test of references that never saw tfdist: one zygote without tfdist for both.
@pytest.mark.xdist_group("without_tfdist")
def test_plain_keras_programs_are_untouched_by_a_tfdist_strategy_in_the_process(tmp_path):
    # The reference is forked from a zygote that imported TensorFlow and Keras, never tfdist.
    never_saw_tfdist = _programs(tmp_path / "plain", env={**os.environ, zygote.WITHOUT_TFDIST_VARIABLE: "1"})
    after_tfdist = _programs(tmp_path / "after", "--after-a-tfdist-strategy", env=dict(os.environ))
    assert never_saw_tfdist.pop("tfdist_imported") is False and after_tfdist.pop("tfdist_imported") is True
    # The EMA and accumulation script trains under TensorFlow's OneDeviceStrategy as without a strategy (after a
    # tfdist strategy it ended with every weight 0.0, when tfdist's patches served every strategy).
    ema = "one_device_ema_and_accumulation"
    assert never_saw_tfdist[f"tensorflow_{ema}"] == never_saw_tfdist[ema] and "weights" in never_saw_tfdist[ema]
    # Keras's own bugs under TensorFlow's strategies stay Keras's: tfdist fixes them only for its own strategies.
    assert never_saw_tfdist["tensorflow_mirrored_accumulation"]["error"].startswith("RuntimeError")
    assert "CollectiveReduceV2" in never_saw_tfdist["tensorflow_mirrored_mixed_precision"]["traced_ops"]
    # exact: both processes run Keras's own code on the same kernels, with TensorFlow's op determinism on.
    for program, expected in never_saw_tfdist.items():
        assert after_tfdist[program] == expected, program
