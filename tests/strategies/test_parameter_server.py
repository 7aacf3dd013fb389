"""Parameter-server training from Keras 3 fit: real worker and ps processes on loopback."""

import json
import os
import re
import signal
import socket
import subprocess
import sys

import psutil
import pytest

from helpers import ROOT, SCENARIO_DIR, free_ports, patient, run_tfdist, tfdist_command, why_it_failed
import zygote
from tfdist.cluster.loopback import LOWEST_PORT, port_is_free
from tfdist.launch.process_tree import descendants

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

SCENARIOS = os.path.join(SCENARIO_DIR, "ps_scenarios.py")


def _scenario(name, timeout=240, stderr=False):
    """The scenario's JSON result (and its stderr, if asked)."""
    proc = zygote.run(
        [sys.executable, SCENARIOS, name], capture_output=True, text=True, timeout=patient(timeout), cwd=ROOT
    )
    assert proc.returncode == 0, why_it_failed(proc.stderr)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return (result, proc.stderr) if stderr else result


def test_a_sharded_embedding_spreads_over_the_parameter_servers_and_matches_a_whole_one():
    result = _scenario("sharded_embedding_matches_a_whole_one")
    assert result["shard_rows"] == [150, 150]
    # Round robin from wherever the strategy's count of variables stands: one shard each.
    assert sorted(result["shard_devices"]) == [f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in (0, 1)]
    assert result["table_diff"] <= 1e-5
    assert result["dense_diff"] <= 1e-5
    assert result["reloaded_on_one_device_diff"] <= 1e-6


def test_float16_gradients_train_as_one_device_to_float16_precision():
    result = _scenario("float16_gradients_match_one_device")
    assert result["max_change"] > 0.05  # it trained
    # Rounded to float16 on the way (else the difference would be float32 round-off, < 1e-6), and no more.
    assert 1e-6 < result["max_diff"] <= 1e-3, result


@pytest.fixture(scope="module")
def keras_usage():
    """The feature matrix, any dataset size and short epochs: one scenario, one cluster per worker count."""
    return _scenario("keras_usage", timeout=360)


# The three tests below run on one pytest worker, so the scenario runs once, within the first one's time.
on_one_worker = pytest.mark.xdist_group("ps_keras_usage")


@on_one_worker
@pytest.mark.timeout(420)
def test_keras_features_match_one_device_with_one_worker_and_run_their_steps_with_two(keras_usage):
    """The Keras feature matrix. One worker runs the steps in order, so everything matches one
    device; with two the updates are asynchronous (weights and per-step values differ), but every
    feature still runs, for exactly the steps asked, with the same History and a model that reloads."""
    result = dict(keras_usage["feature_matrix"])
    unknown = result.pop("tf_data_unknown_size")
    for workers in ("1", "2"):
        assert "pass `steps_per_epoch`" in unknown[workers].get("error", ""), unknown
    failed = {name: runs for name, runs in result.items() if any("error" in run for run in runs.values())}
    assert not failed, failed
    for name, runs in result.items():
        one, two = runs["1"], runs["2"]
        assert one["weights_diff"] <= 1e-5 and one["history_diff"] <= 1e-5, (name, one)
        assert one["reloaded_predict_diff"] <= 1e-5 and one["evaluate_diff"] <= 1e-5, (name, one)
        for run in (one, two):
            assert run["history_keys"] and set(run["epochs"]) == {2}, (name, run)
            assert run["iterations"] == run["reference_iterations"], (name, run)  # 44: steps_per_execution too


@on_one_worker
@pytest.mark.timeout(420)
def test_any_dataset_size_matches_one_device_with_one_worker_and_runs_with_two(keras_usage):
    one, two = keras_usage["any_dataset_size"]["1"], keras_usage["any_dataset_size"]["2"]
    for key in ("history_diff", "weights_diff", "evaluate_diff", "predictions_diff"):
        assert one[key] <= 1e-5, (key, one)
    for run in (one, two):
        assert run["history_keys"] == ["accuracy", "loss", "val_accuracy", "val_loss"] and run["epochs"] == [2]
        assert run["predictions_shape"] == [5, 3]


@on_one_worker
@pytest.mark.timeout(420)
def test_every_epoch_reports_its_training_metrics_and_fewer_batches_than_workers_train(keras_usage):
    result = keras_usage["short_epochs"]
    assert len(result["loss"]) == len(result["accuracy"]) == 6
    assert all(loss > 0 for loss in result["loss"]) and all(0 <= a <= 1 for a in result["accuracy"])
    # A worker with an empty shard trains on the whole dataset: 8 one-step epochs, none failing.
    assert len(result["one_batch_loss"]) == 8
    assert result["iterations"] == 6 * 2 + 8


def test_a_metric_read_mid_epoch_never_has_a_step_in_its_total_that_its_count_lacks():
    """The chief reads the metrics while two workers update them: a total and its count
    must come from the same steps (an accuracy above 1 was seen)."""
    result = _scenario("mid_epoch_metric_reads")
    assert result["reads"] >= 50  # 64 steps, read at each
    assert result["max_ratio"] <= 1.0, result
    assert result["epoch_ratios"] == [1.0]


def test_a_killed_worker_is_restarted_and_training_completes():
    result, stderr = _scenario("killed_worker_is_restarted", stderr=True)
    assert result["epochs"] == 3
    assert result["restarts"] >= 1
    assert "tfdist: local worker 1 exited (code -9); restarting it" in stderr
    assert "cluster_coordinator.py" not in stderr  # the coordinator's own error logs are held back
    # No step is lost: the killed worker's steps were rescheduled. A step it had
    # applied just before dying may run again (at-least-once), at most one per
    # step it had in flight.
    assert result["steps"] <= result["iterations"] <= result["steps"] + 2
    assert result["val_accuracy"] > 0.6


def test_a_killed_parameter_server_is_a_prompt_clear_error():
    result = _scenario("killed_ps_is_an_error")
    assert result["error"] is not None
    assert result["error"].startswith("lost a parameter server, ps 0 at 127.0.0.1:")
    assert "checkpoint.dir" in result["error"]
    assert result["seconds_after_kill"] < 30


def test_a_port_another_process_took_before_its_task_listens_is_replaced_not_shared(monkeypatch, capfd):
    """In CI another job's task once took a parameter server's port while that server started: the
    port still accepted connections, so the chief trained against a stranger's task and both jobs
    failed. Here a listener of this process holds the port the first choice gives the parameter server."""
    from tfdist.cluster import servers
    from tfdist.cluster.loopback import listens

    stranger = socket.create_server(("0.0.0.0", 0))
    taken = stranger.getsockname()[1]
    choices = iter([[*free_ports(2), taken]])  # chief, worker, ps
    monkeypatch.setattr(servers, "free_loopback_ports", lambda count: next(choices, None) or free_ports(count))
    try:
        with servers.LocalCluster(num_workers=1, num_ps=1) as cluster:
            assert f"127.0.0.1:{taken}" not in str(cluster.cluster_spec)
            for (job, index), process in cluster.processes.items():
                port = int(cluster.cluster_spec[job][index].rsplit(":", 1)[1])
                assert listens(process.pid, port), (job, index)
    finally:
        stranger.close()
    assert f"tfdist: another process took port {taken} of local ps 0; starting the local cluster again on " \
           "other ports" in capfd.readouterr().err


def test_a_dead_worker_whose_port_another_process_took_is_given_up_once_not_restarted_forever(monkeypatch, capfd):
    """A worker restarted on a port held by another process exits at once: restarting it every half
    second would print a line each time for the rest of the job."""
    from tfdist.cluster import servers

    monkeypatch.setattr(servers, "PORT_HELD_GRACE_SECONDS", 0)
    cluster = servers.LocalCluster(num_workers=2, num_ps=1)
    spawned = []
    monkeypatch.setattr(cluster, "_spawn", lambda job, index: spawned.append((job, index)))
    for index in (0, 1):
        dead = zygote.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
        dead.wait(timeout=patient(60))
        cluster.processes["worker", index] = dead
    port = int(cluster.cluster_spec["worker"][1].rsplit(":", 1)[1])
    with socket.create_server(("0.0.0.0", port)):
        cluster._restart_dead_workers()
        cluster._restart_dead_workers()
    assert spawned == [("worker", 0), ("worker", 0)] and cluster.lost_workers == {1} and cluster.restarts == 2
    err = capfd.readouterr().err
    assert err.count(f"tfdist: local worker 1 exited (code -9) and another process holds its port {port} "
                     f"({psutil.Process().name()} pid {os.getpid()} LISTEN); not restarting it; its steps run on the others") == 1, err


def test_jobs_choosing_ports_at_once_never_get_the_same_one():
    """20 processes choosing 40 ports each at once: 800 of the ~22,000 below the ephemeral range would
    share one about 14 times by chance; reserved on this machine, none does."""
    script = "from tfdist.cluster.loopback import free_loopback_ports as f; print(*f(20), *f(20))"
    processes = [zygote.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
                 for _ in range(20)]
    ports = [int(port) for process in processes for port in process.communicate(timeout=patient(120))[0].split()]
    assert all(process.returncode == 0 for process in processes)
    assert len(ports) == 800 and len(set(ports)) == 800


def test_a_half_written_reservation_is_dropped_not_fatal(tmp_path, monkeypatch):
    from tfdist.cluster import loopback

    reservations = tmp_path / "ports"
    reservations.write_text(f"{LOWEST_PORT} 1e12\n123")  # the second line cut short by a kill
    monkeypatch.setattr(loopback, "RESERVATIONS", str(reservations))
    ports = free_ports(3)
    kept = reservations.read_text().split("\n")
    assert f"{LOWEST_PORT} 1000000000000.0" in kept and "123" not in kept
    assert LOWEST_PORT not in ports and all(any(line.startswith(f"{port} ") for line in kept) for port in ports)


def test_free_ports_come_from_below_the_ephemeral_range_and_are_free():
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral = int(f.read().split()[0])
    ports = free_ports(8)
    assert len(set(ports)) == 8 and all(LOWEST_PORT <= p < ephemeral and port_is_free(p) for p in ports)
    block = free_ports(4, consecutive=True)
    assert block == list(range(block[0], block[0] + 4)) and block[-1] < ephemeral


@pytest.mark.slow
def test_a_parameter_server_lost_before_a_checkpoint_save_is_the_same_one_line():
    result = _scenario("ps_lost_before_a_save")
    assert result["raised"] is not None, result
    assert (result["error"] or "").startswith("lost a parameter server, ps 0 at 127.0.0.1:"), result


def test_config_trains_digits_to_095_from_one_command(tmp_path):
    metrics = tmp_path / "metrics.json"
    proc = run_tfdist(
        "train", "--config", "configs/parameter_server.yaml", "--metrics_out", str(metrics), timeout=400
    )
    assert proc.returncode == 0, why_it_failed(proc.stderr)
    result = json.loads(metrics.read_text())
    assert result["strategy"] == "parameter_server"
    assert result["final"]["val_accuracy"] >= 0.95
    assert "Epoch 1/" in proc.stdout
    assert "cluster         2 worker(s), 1 parameter server(s) (local processes)" in proc.stdout


@pytest.mark.slow
def test_sharded_config_trains_digits_to_095_with_the_table_on_both_servers(tmp_path):
    metrics = tmp_path / "metrics.json"
    proc = run_tfdist(
        "train", "--config", "configs/parameter_server_sharded.yaml", "--metrics_out", str(metrics), timeout=400
    )
    assert proc.returncode == 0, why_it_failed(proc.stderr)
    result = json.loads(metrics.read_text())
    assert result["final"]["val_accuracy"] >= 0.95
    assert result["sharded_tables"] in ("sharded_embedding in 2 shard(s) on ps 0, 1",
                                        "sharded_embedding in 2 shard(s) on ps 1, 0")
    assert f"sharded tables  {result['sharded_tables']}" in proc.stdout
    # Logs are read consistently: a metric's total and count never come from different moments.
    accuracies = [float(v) for v in re.findall(r" accuracy: ([0-9.]+)", proc.stdout)]
    assert accuracies and max(accuracies) <= 1.0


def _local_tasks(parent_pid, job):
    """PIDs of the local `job` processes ("ps" or "worker") that `parent_pid` started."""
    found = []
    for pid in descendants(zygote.forked_child(parent_pid) or parent_pid)[1:]:
        try:
            with open(f"/proc/{pid}/cmdline") as f:
                args = f.read().split("\0")
        except OSError:
            continue
        if job in args and any("tfdist.cluster.servers" in a for a in args):
            found.append(pid)
    return found


def _cli_default_env():
    """The environment of a user who has not set TensorFlow's log level: tfdist's own default applies."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    return env


def test_a_restarted_worker_is_one_line_on_the_users_screen(tmp_path):
    # The chief's reconnect attempts used to print 40-118 lines of gRPC errors, and every server its
    # TensorFlow start-up banner.
    command = tfdist_command("train", "--config", "configs/parameter_server.yaml", "--set", "train.epochs=4",
                             "--set", "train.verbose=2", "--metrics_out", str(tmp_path / "metrics.json"))
    proc = zygote.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                        env=_cli_default_env())
    try:
        for line in proc.stdout:
            if line.startswith("Epoch 2/4"):
                os.kill(_local_tasks(proc.pid, "worker")[0], signal.SIGKILL)
                break
        out, err = proc.communicate(timeout=patient(240))
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert re.fullmatch(r"tfdist: local worker \d exited \(code -9\); restarting it; "
                        r"its steps run on the others meanwhile\n", err), err[-3000:]


@pytest.mark.slow
def test_after_a_lost_parameter_server_a_rerun_resumes_from_the_checkpoint(tmp_path):
    metrics = tmp_path / "metrics.json"
    command = tfdist_command(
        "train", "--config", "configs/parameter_server.yaml",
        "--set", "train.epochs=6", "--set", "train.verbose=2",
        "--set", f"checkpoint.dir={tmp_path / 'ckpt'}", "--metrics_out", str(metrics),
    )
    env = _cli_default_env()
    first = zygote.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        for line in first.stdout:
            if line.startswith("Epoch 3/6"):  # epochs 1 and 2 are saved
                for pid in _local_tasks(first.pid, "ps"):
                    os.kill(pid, 9)
                break
        out, err = first.communicate(timeout=patient(120))
    finally:
        first.kill()
    assert first.returncode == 1, err[-3000:]
    # The user's screen is one line, not the coordinator's 70-150 lines of gRPC detail.
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tfdist: error: lost a parameter server"), err[-3000:]
    assert "checkpoint.dir" in lines[0], err[-3000:]

    second = zygote.run(command, cwd=ROOT, capture_output=True, text=True, env=env, timeout=patient(300))
    assert second.returncode == 0, why_it_failed(second.stderr)
    epochs = [line.split()[1] for line in second.stdout.splitlines() if line.startswith("Epoch ")]
    assert epochs[0] == "3/6" and epochs[-1] == "6/6"  # resumed at the last saved epoch end
    result = json.loads(metrics.read_text())
    assert result["resumed_from_step"] == 2 * result["steps_per_epoch"]
