"""Every Keras optimizer, with every option Keras gives it, trains under each of tfdist's kinds to the weights and
losses Keras alone trains, or is refused in one line before training (tests/optimizer_cells.py says which and why;
tools/optimizer_table.py writes docs/optimizers.md's table from these tests' results). The reference comes from a
process that never imported tfdist."""

import json
import os
import subprocess
import sys

import numpy as np
import optimizer_cells as cells
import pytest
import zygote
from helpers import ROOT, SCENARIO_DIR, free_ports, patient, why_it_failed

SCRIPT = os.path.join(SCENARIO_DIR, "optimizer_matrix.py")
IN_ONE_PROCESS = [kind for kind, how in cells.KINDS.items() if not how.get("processes")]
ACROSS_PROCESSES = [kind for kind, how in cells.KINDS.items() if how.get("processes")]


def _start(out, kinds=(), env=None):
    return zygote.Popen([sys.executable, SCRIPT, str(out), *(f"--kind={kind}" for kind in kinds)], cwd=ROOT,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or dict(os.environ))


def _finish(procs, timeout):
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=patient(timeout))
            assert proc.returncode == 0, why_it_failed(err)
    finally:
        for proc in procs:
            proc.kill()  # a worker whose peer died waits in a collective


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """kind ("keras" for the reference) -> cell -> what it trained. The reference and the one-process kinds run
    side by side, then the two workers of the multi-process kind."""
    out = tmp_path_factory.mktemp("optimizer_matrix")
    _finish([_start(out / "keras.json", env={**os.environ, zygote.WITHOUT_TFDIST_VARIABLE: "1"}),
             _start(out / "one_process.json", IN_ONE_PROCESS)], timeout=300)
    workers = [f"127.0.0.1:{port}" for port in free_ports(2)]
    _finish([_start(out / f"worker-{i}.json", ACROSS_PROCESSES, env={**os.environ, "TF_CONFIG": json.dumps(
        {"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}})}) for i in range(2)], timeout=300)
    results = {**json.loads((out / "keras.json").read_text()), **json.loads((out / "one_process.json").read_text())}
    worker_0, worker_1 = (json.loads((out / f"worker-{i}.json").read_text()) for i in range(2))
    for kind in ACROSS_PROCESSES:  # the workers hold the same weights
        assert {cell: r.get("weights") for cell, r in worker_0[kind].items()} == {
            cell: r.get("weights") for cell, r in worker_1[kind].items()}
    return {**results, **worker_0}


@pytest.mark.xdist_group("optimizer_matrix")
@pytest.mark.timeout(900)  # the first test's: the fixture's two rounds of processes, each bound by its own limit
@pytest.mark.parametrize("optimizer", list(cells.OPTIMIZERS))
@pytest.mark.parametrize("kind", list(cells.KINDS))
def test_every_option_trains_the_weights_of_keras_alone_or_is_refused_before_training(trained, kind, optimizer):
    for options in cells.OPTIONS:
        reference, result = trained["keras"][f"{optimizer}|{options}"], trained[kind][f"{optimizer}|{options}"]
        assert "weights" in reference, (options, reference)
        refusal = cells.refusal(optimizer, options, kind)
        if refusal:
            assert refusal[0] in result.get("refused", "") and " lines)" not in result["refused"], (options, result)
            continue
        assert "weights" in result, (options, result)
        difference = max(float(np.abs(np.subtract(a, b)).max())
                         for a, b in zip(reference["weights"], result["weights"]))
        assert difference <= cells.TOLERANCE, (options, difference)
        np.testing.assert_allclose(result["loss"], reference["loss"], rtol=0, atol=cells.TOLERANCE, err_msg=options)


def test_the_pages_table_is_what_a_run_of_every_passing_cell_writes():
    """`make test` checks the page against its own run's results (tools/optimizer_table.py --check); this checks the
    page and the cells' definitions against each other at once."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import optimizer_table

    every_cell_passed = {cells.test_of(name, kind): "passed" for name in cells.OPTIMIZERS for kind in cells.KINDS}
    page = open(optimizer_table.PAGE, encoding="utf-8").read()
    assert optimizer_table.render_page(page, every_cell_passed) == page
