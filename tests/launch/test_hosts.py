"""`tfdist launch --hosts N --link RATE`: jobs across network-namespace hosts, and nothing left behind."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import (ROOT, launch_job, launch_output, launch_output_after, patient, processes_with, run_tfdist,
                     task_pid, tcp_bytes)
import zygote

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300), pytest.mark.xdist_group("namespace_hosts"),
              pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces and tc need root")]

GRADIENT_BYTES = 153_128  # the digits CNN's float32 weights (configs/default.yaml's model)
SHORT = ["--set", "train.epochs=1", "--set", "train.steps_per_epoch=15"]
KINDS = {
    "multi_worker": ["--workers", "2", "--config", "configs/default.yaml",
                     "--set", "strategy.kind=multi_worker_mirrored"],
    "parameter_server": ["--workers", "1", "--config", "configs/parameter_server.yaml"],
    # Horovod's ranks negotiate every cycle, idle or not: at the config's 1 ms, steps slowed down by a busy
    # machine carried 12% more than the gradients' bytes (the bound is 10%); 20 ms cycles kept them within it.
    "horovod": ["--workers", "2", "--config", "configs/horovod.yaml", "--set", "horovod.cycle_time_ms=20"],
}
KINDS["multi_worker_fp16"] = [*KINDS["multi_worker"], "--set", "strategy.gradient_compression=fp16"]


def leftovers():
    """What of any job's hosts is still here: namespaces, links, /etc/netns files, owner files."""
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    found = [name for name in namespaces if name.startswith("tfd")]
    found += [link for link in os.listdir("/sys/class/net") if link.startswith("tfd")]
    found += [f"/etc/netns/{name}" for name in os.listdir("/etc/netns")] if os.path.isdir("/etc/netns") else []
    found += os.listdir("/run/tfdist/hosts") if os.path.isdir("/run/tfdist/hosts") else []
    return found


@pytest.mark.parametrize("kind", [pytest.param(k, marks=[pytest.mark.horovod] if k == "horovod" else [])
                                  for k in KINDS])
def test_every_multi_process_kind_trains_across_two_hosts_and_leaves_nothing(tmp_path, kind):
    metrics = tmp_path / "metrics.json"
    proc = launch_job(metrics, "--hosts", "2", "--link", "1gbit", *KINDS[kind], *SHORT)
    out, err = launch_output(proc)
    assert proc.returncode == 0, err[-3000:]
    result = json.loads(metrics.read_text())
    link = result["link_bytes_per_step"]
    if kind == "parameter_server":  # the worker reads every variable and sends every gradient each step
        assert link["sent"] >= GRADIENT_BYTES and link["received"] >= GRADIENT_BYTES, link
    else:
        # A ring all-reduce over 2 hosts: each sends and receives 2 (N - 1) / N = 1 x the gradient bytes;
        # compressed to float16, half that. On top: TCP's headers and acknowledgements and a step's requests
        # (a busy machine's receiver acknowledges every segment: 1.10 x the bytes once), and what TCP resent.
        wire_bytes = GRADIENT_BYTES / 2 if kind.endswith("fp16") else GRADIENT_BYTES
        resent = (result.get("link_retransmits_per_step") or 0.0) * 1514
        for direction in ("sent", "received"):
            assert 0.95 * wire_bytes <= link[direction] <= tcp_bytes(wire_bytes, wire_bytes) + resent, link
    assert "link traffic" in out
    assert leftovers() == [] and processes_with(str(metrics)) == []


def test_a_killed_task_and_an_interrupted_launcher_leave_nothing(tmp_path):
    metrics = tmp_path / "metrics.json"
    long = ["--set", "train.epochs=100", "--set", "train.verbose=2"]
    proc = launch_job(metrics, "--hosts", "2", *KINDS["multi_worker"], *long)
    out, err = launch_output_after(
        proc, "Epoch 2/", lambda: os.kill(task_pid(str(metrics), "TF_CONFIG", '"index": 1'), signal.SIGKILL))
    assert err.strip().splitlines()[-1].startswith("tfdist launch: error: worker 1 failed (killed by SIGKILL)"), err
    assert leftovers() == [] and processes_with(str(metrics)) == []

    proc = launch_job(metrics, "--hosts", "2", "--link", "100mbit", *KINDS["multi_worker"], *long)
    out, err = launch_output_after(proc, "Epoch 2/", lambda: proc.send_signal(signal.SIGINT))
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    assert leftovers() == [] and processes_with(str(metrics)) == []


def test_the_hosts_of_a_launcher_killed_outright_are_removed_by_its_reaper_or_else_by_the_next_job():
    def hosts_made_then_killed(reaper_too=False):
        made = subprocess.Popen([sys.executable, "-c", "import time; from tfdist.launch.hosts import NamespaceHosts; "
                                 "hosts = NamespaceHosts(2, '1gbit'); print(hosts.tag, flush=True); time.sleep(60)"],
                                cwd=ROOT, stdout=subprocess.PIPE, text=True)
        tag = made.stdout.readline().strip()
        if reaper_too:
            reaper = [pid for pid in os.listdir("/proc")
                      if pid.isdigit() and _command_line(pid)[-3:-1] == ["--reap", tag]]
            assert len(reaper) == 1, reaper
            os.kill(int(reaper[0]), signal.SIGKILL)
        made.kill()  # SIGKILL: it cannot clean up
        made.wait()
        return tag

    hosts_made_then_killed()
    gone = time.monotonic() + 10
    while leftovers() and time.monotonic() < gone:  # the reaper removes them
        time.sleep(0.2)
    assert leftovers() == []

    tag = hosts_made_then_killed(reaper_too=True)
    abandoned = {f"{tag}-h0", f"{tag}-h1", tag, f"{tag}v0", f"{tag}v1"}
    assert abandoned <= set(leftovers()), leftovers()

    from tfdist.launch.hosts import NamespaceHosts

    with NamespaceHosts(1) as hosts:  # one host: whatever else is here is the abandoned job's
        # The namespace, the bridge (and its owner file, of the same name), the veth, the hosts file.
        assert set(leftovers()) == {f"{hosts.tag}-h0", hosts.tag, f"{hosts.tag}v0", f"/etc/netns/{hosts.tag}-h0"}, \
            leftovers()
    assert leftovers() == []


def test_a_python_process_on_a_host_is_forked_from_the_test_zygote_into_the_hosts_namespaces():
    """The tasks on namespace hosts fork from the zygote too: the child joins its client's network and mount
    namespaces, so it has the host's address and its /etc/hosts (its name resolves to that address)."""
    from tfdist.launch.hosts import NamespaceHosts

    probe = ("import os, socket, sys; print('tensorflow' in sys.modules, os.readlink('/proc/self/ns/net'), "
             "socket.gethostbyname(socket.gethostname()))")
    with NamespaceHosts(1) as hosts:
        done = zygote.run(hosts.command(0, [sys.executable, "-c", probe]), capture_output=True, text=True,
                          timeout=patient(60), cwd=ROOT)
        assert done.returncode == 0, done.stderr[-2000:]
        imported, network, address = done.stdout.split()
        assert imported == "True"  # forked: TensorFlow was imported before it started
        assert network != os.readlink("/proc/self/ns/net") and address == hosts.addresses[0]
    assert leftovers() == []


def _command_line(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def _between_two_hosts(link: str, script: str) -> tuple[str, str, int]:
    """Runs `script serve ADDRESS` on host 1 of two linked at `link` (it prints 'ready' once it listens),
    then `script send ADDRESS` on host 0; returns what the sender printed, what the server printed once
    the sender was done, and the bytes host 0 sent over its link."""
    from tfdist.launch.hosts import NamespaceHosts

    with NamespaceHosts(2, link) as hosts:
        server = subprocess.Popen(hosts.command(1, [sys.executable, "-c", script, "serve", hosts.addresses[1]]),
                                  stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().strip() == "ready"
        sender = subprocess.run(hosts.command(0, [sys.executable, "-c", script, "send", hosts.addresses[1]]),
                                capture_output=True, text=True, timeout=patient(30), check=True)
        served = server.communicate(timeout=patient(30))[0]
        sent, _ = hosts.link_bytes(0)
    return sender.stdout, served, sent


def test_a_link_carries_its_rate(tmp_path):
    stream = ("import socket, sys, time\n"
              "if sys.argv[1] == 'serve':\n"
              "    server = socket.create_server((sys.argv[2], 5001)); print('ready', flush=True)\n"
              "    connection, _ = server.accept(); received = 0; start = time.perf_counter()\n"
              "    while chunk := connection.recv(1 << 20): received += len(chunk)\n"
              "    print(received * 8 / (time.perf_counter() - start))\n"
              "else:\n"
              "    connection = socket.create_connection((sys.argv[2], 5001)); end = time.perf_counter() + 2\n"
              "    while time.perf_counter() < end: connection.sendall(b'x' * (1 << 16))\n")
    _, served, sent = _between_two_hosts("100mbit", stream)
    bits_per_second = float(served)
    assert 0.85e8 <= bits_per_second <= 1.02e8, bits_per_second
    assert sent >= bits_per_second / 8 * 1.5  # the host's counters saw the stream
    assert leftovers() == []


def test_a_steps_transfer_after_idle_takes_its_time_at_the_rate():
    """A gradient's worth of bytes (600 KB) sent after the link was idle, as a job sends each step, takes
    what the rate allows: tbf's bucket must not let it through faster (with 4 ms of burst it took 1.5 ms
    at 1 Gbit/s, not 5). The fastest of 15 exchanges is checked: a busy CPU only adds time to an exchange,
    and a bucket that lets bytes through early shows in every one, the fastest first."""
    from tfdist.plan.cluster import HOST_LINK_EFFICIENCY

    exchange = ("import socket, sys, time\n"
                "size = 600_000\n"
                "if sys.argv[1] == 'serve':\n"
                "    server = socket.create_server((sys.argv[2], 5002)); print('ready', flush=True)\n"
                "    connection, _ = server.accept()\n"
                "    while (received := len(connection.recv(size, socket.MSG_WAITALL))) == size:\n"
                "        connection.sendall(b'k')\n"
                "else:\n"
                "    connection = socket.create_connection((sys.argv[2], 5002)); times = []\n"
                "    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n"
                "    for _ in range(15):\n"
                "        time.sleep(0.02); start = time.perf_counter()\n"
                "        connection.sendall(b'x' * size); connection.recv(1)\n"
                "        times.append(time.perf_counter() - start)\n"
                "    print(min(times))\n")
    seconds = float(_between_two_hosts("1gbit", exchange)[0])
    at_rate = 600_000 / (HOST_LINK_EFFICIENCY * 1e9 / 8)  # 5.1 ms
    assert 0.85 * at_rate <= seconds <= 1.5 * at_rate, (seconds, at_rate)
    assert leftovers() == []


@pytest.mark.parametrize("flags,message", [
    (["--link", "1gbit", *KINDS["multi_worker"]], "--link shapes the links of --hosts: give --hosts N too."),
    (["--hosts", "2", "--link", "fast", *KINDS["multi_worker"]], "`--link` must be a rate in tc's notation"),
    (["--hosts", "3", *KINDS["multi_worker"]], "`--hosts` must be at most the job's 2 tasks"),
    (["--hosts", "2", "--workers", "1", "--config", "configs/default.yaml"],
     "`--hosts` applies to jobs of several processes"),
    (["--hosts", "3", *KINDS["horovod"]], "`--hosts` must be at most the job's 2 Horovod ranks"),
])
def test_hosts_that_do_not_fit_the_job_are_one_line_and_leave_nothing(flags, message):
    proc = run_tfdist("launch", *flags)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("tfdist: error: " + message), lines
    assert leftovers() == []


def test_without_root_or_tc_it_is_one_line_saying_what_is_missing(monkeypatch):
    from tfdist.errors import HostsError
    from tfdist.launch import hosts

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(HostsError, match=r"^--hosts needs root: .* leave out --hosts to run on loopback\)$"):
        hosts.NamespaceHosts(2)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(hosts.shutil, "which", lambda tool: None if tool == "tc" else f"/usr/sbin/{tool}")
    with pytest.raises(HostsError, match=r"^--hosts needs tc \(Debian: apt-get install iproute2\)$"):
        hosts.NamespaceHosts(2)
    assert leftovers() == []
