"""The pip route: tfdist with its extras into a clean virtual environment, and its command works there."""

import os
import subprocess
import sys

import pytest

from helpers import ROOT, patient, why_it_failed


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pip_installs_tfdist_with_extras_into_a_clean_venv_and_it_trains(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=patient(120))
    bin_dir = venv / "bin"
    # --no-compile: pip would byte-compile all of TensorFlow (15 CPU-seconds); what the commands below import
    # is compiled as they import it.
    install = subprocess.run([str(bin_dir / "pip"), "install", "--quiet", "--no-compile", f"{ROOT}[cpu,k8s]"],
                             capture_output=True, text=True, timeout=patient(840))
    assert install.returncode == 0, why_it_failed(install.stderr)
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", TF_CPP_MIN_LOG_LEVEL="2")
    # The copy pip installed, not this checkout: run from elsewhere.
    where = subprocess.run([str(bin_dir / "python"), "-c", "import tfdist; print(tfdist.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, env=env, timeout=patient(60))
    assert where.stdout.startswith(str(venv)), where.stdout + where.stderr
    help_text = subprocess.run([str(bin_dir / "tfdist"), "k8s", "--help"], capture_output=True, text=True,
                               cwd=tmp_path, env=env, timeout=patient(60))
    assert help_text.returncode == 0 and "--flavor" in help_text.stdout, help_text.stderr
    train = subprocess.run([str(bin_dir / "tfdist"), "train", "--set", "train.epochs=1", "--set",
                            "train.steps_per_epoch=4", "--set", "train.verbose=0"],
                           capture_output=True, text=True, cwd=tmp_path, env=env, timeout=patient(300))
    assert train.returncode == 0, why_it_failed(train.stderr)
    assert "tfdist summary" in train.stdout
    # The k8s extra: manifests are validated with the packages it brings.
    manifests = subprocess.run([str(bin_dir / "tfdist"), "k8s", "--image", "repo/tfdist:0.1", "--workers", "2",
                                "--set", "strategy.kind=multi_worker_mirrored", "--out", str(tmp_path / "k8s")],
                               capture_output=True, text=True, cwd=tmp_path, env=env, timeout=patient(120))
    assert manifests.returncode == 0, why_it_failed(manifests.stderr)
