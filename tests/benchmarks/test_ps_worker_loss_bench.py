"""`tfdist bench ps_worker_loss`: workers really die, and the steps the parameter server applied are counted."""

import json

import pytest

from helpers import run_tfdist, why_it_failed

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(400)]


def test_killed_rounds_lose_no_step_and_repeat_at_most_the_one_in_flight(tmp_path):
    out = tmp_path / "ps_worker_loss.json"
    proc = run_tfdist("bench", "ps_worker_loss", "--json", str(out), "--repeats", "1", timeout=360)
    assert proc.returncode == 0, why_it_failed(proc.stderr)
    result = json.loads(out.read_text())
    figures = result["figures"]
    steps = result["steps_per_round"]
    assert figures["kills"] == len(result["applied_steps"]) == 2  # the warm-up round's kill and the timed one's
    assert proc.stderr.count("tfdist: local worker 1 exited (code -9); restarting it") == 2
    assert all(steps // 8 <= batch < steps // 2 for batch in result["kill_after_batch"])
    # ClusterCoordinator reruns the dead worker's closure elsewhere: nothing is lost, and
    # with one step per closure at most that one step is applied twice.
    assert figures["lost_steps"] == 0
    assert all(steps <= applied <= steps + 1 for applied in result["applied_steps"])
    assert figures["extra_steps_max"] == max(result["applied_steps"]) - steps
    assert figures["seconds_per_kill"] == pytest.approx(
        result["round_seconds"]["killed"] - result["round_seconds"]["plain"])
    assert "machine" in result and "seconds_per_kill=" in proc.stdout
