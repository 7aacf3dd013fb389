"""`tfdist launch`: every task of a multi-process job as local processes, on loopback or on namespace hosts.

    tfdist launch --workers 2 --config configs/default.yaml --set strategy.kind=multi_worker_mirrored
    tfdist launch --workers 2 --ps 1 --config configs/parameter_server.yaml
    tfdist launch --workers 2 --config configs/horovod.yaml      # runs horovodrun for you
    tfdist launch --workers 2 --hosts 2 --link 1gbit --config ...  # on 2 hosts linked at 1 Gbit/s

With `--hosts`, the tasks run on network-namespace hosts of this machine
(`tfdist.launch.hosts`): parameter servers each on a host of their own, the
other tasks spread over the rest; horovodrun reaches its hosts with ssh.

Each task is `tfdist train` with the same config, or the user's own command
(`tfdist launch ... -- python train.py`), with its own `TF_CONFIG` (ports on
127.0.0.1 chosen free: `tfdist.cluster.loopback`); Horovod jobs are one
`horovodrun -np N --gloo`. Under parameter servers the user's command runs
on the chief, and the workers and servers are `tfdist serve` (or the command
too, with `every_task`). The reporting task's output (the chief,
else worker 0, else rank 0) passes through as it is, so Keras's progress bar
keeps working; every other line is prefixed with its task (`[worker 1] ...`). The first task that fails
stops the others: the launcher prints one line naming it and exits with its
code (128 + N for a signal N), or, with `--max_restarts N`, says why and runs
the whole job again, up to N times (with `checkpoint.dir` it resumes from its
last checkpoint). SIGINT and SIGTERM reach every task. Nothing is left running
when it returns, and a launcher killed outright (SIGKILL) takes its tasks
with it within seconds (`tfdist.launch.guard`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pty
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Optional, Sequence, TextIO

from tfdist.checkpoint_store import EXIT_PREEMPTED, EXIT_TERMINATED, SIGTERM_RECEIVED
from tfdist.config.loading import CLUSTER_VARIABLE
from tfdist.config.kinds import RANKS, kinds_where
from tfdist.config.schema import Config
from tfdist.errors import PEER_LOST_UNDER_HOROVOD, ConfigError
from tfdist.cluster.loopback import free_loopback_ports
from tfdist.cluster.roles import cluster_of, multi_process_kinds
from tfdist.launch import guard, process_tree
from tfdist.launch.hosts import NamespaceHosts

__all__ = ["Task", "plan", "run"]

STOP_GRACE_SECONDS = 10  # after SIGTERM, before SIGKILL
# Once a task has failed, the others' collectives cannot finish: they get this long, then SIGKILL
# (a survivor blocked in a collective does not run Python's SIGTERM handler until it returns).
# horovodrun keeps STOP_GRACE_SECONDS: it stops its ranks itself.
FAILED_JOB_GRACE_SECONDS = 2
STALLED_SECONDS = 20  # by default, a task stopped (SIGSTOP) this long ends the job, naming it
MAX_PREEMPTIONS = 100  # restarts after preemptions, which --max_restarts does not count
_POLL_SECONDS = 0.2
# horovodrun prefixes each rank's output with "[RANK]<stdout>:" and reports a failed rank as
# "Process RANK exit with status code CODE." (horovod/runner/gloo_run.py).
_HOROVOD_PREFIX = re.compile(r"\[(\d+)\]<(stdout|stderr)>:")
_HOROVOD_FAILURE = re.compile(r"^Process (\d+) exit with status code (-?\d+)\.")
# The kinds whose job is several processes; every other kind runs in one.


@dataclasses.dataclass
class Task:
    """One process of the job.

    Attributes:
      role: `chief`, `worker`, `ps`, or `horovodrun` (which starts the ranks itself).
      index: the task's index in its role.
      command: what runs.
      env: the environment it runs with (this one's, plus TF_CONFIG).
      reports: its output passes through unprefixed (the progress bar and summary).
      finishes: the job is done when every task that finishes has exited 0
        (parameter servers, and workers under a chief, serve until stopped).
    """

    role: str
    index: int
    command: list[str]
    env: dict[str, str]
    reports: bool = False
    finishes: bool = True

    @property
    def name(self) -> str:
        return self.role if self.role == "horovodrun" else f"{self.role} {self.index}"


def plan(config: Config, train_args: list[str], *, workers: int, ps: int = 0, chief: bool = False,
         hosts: Optional[NamespaceHosts] = None, command: Sequence[str] = (), every_task: bool = False) -> list[Task]:
    """The tasks that run `config` on this machine.

    Args:
      config: the job's config (its strategy kind decides the roles).
      train_args: the `tfdist train` flags every task gets (--config, --set, --metrics_out).
      workers: worker processes (Horovod: ranks).
      ps: parameter servers (parameter_server kind; 0 takes `parameter_server.num_ps`).
      chief: add a chief to a multi-worker job (the parameter_server kind always has one).
      hosts: run the tasks on these namespace hosts instead of loopback (Horovod: starts their sshd).
      command: a command of the user's that the tasks run instead of `tfdist train` (under parameter
        servers only the chief, the others being `tfdist serve`, unless `every_task`).
      every_task: run `command` on a parameter-server job's workers and servers too.

    Raises:
      ConfigError: the counts do not fit the kind, or the config already names a cluster.
    """
    kind = config.strategy.launched_as
    processes = kind.processes
    if workers < 1:
        raise ConfigError("--workers", "must be at least 1.", workers)
    if config.cluster.workers:
        raise ConfigError("cluster.workers", "must be empty under `tfdist launch`, which chooses the cluster itself.",
                          list(config.cluster.workers))
    if ps and not processes.coordinated:
        coordinated = " or ".join(kinds_where(lambda k: k.processes.coordinated))
        raise ConfigError("--ps", f"only applies with strategy.kind={coordinated}, not {kind.name}.", ps)
    tfdist = [sys.executable, "-m", "tfdist.cli"]
    train = list(command) or [*tfdist, "train", *train_args]
    # A parameter-server job's workers and servers serve what the chief's script schedules.
    serve = train if every_task or not command else [*tfdist, "serve", *train_args]
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", CLUSTER_VARIABLE)}
    env.update(hosts.environment() if hosts else {})
    if processes is RANKS:
        if chief:
            raise ConfigError("--chief", "does not apply to Horovod, whose rank 0 reports.", True)
        horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
        return [Task("horovodrun", 0, [horovodrun, "-np", str(workers), *_horovod_hosts(workers, hosts), "--gloo",
                                       *train], env, reports=True)]
    if not processes.several:
        several = multi_process_kinds()
        if workers > 1 or chief:
            raise ConfigError("--workers", f"must be 1: strategy.kind={kind.name} runs in one process "
                              f"({several} run in several).", workers)
        if hosts:
            raise ConfigError("--hosts", f"applies to jobs of several processes ({several}), not to "
                              f"strategy.kind={kind.name}.", hosts.count)
        return [Task("worker", 0, train, env, reports=True)]
    if processes.coordinated:
        ps = ps or config.parameter_server.num_ps
        chief = True
    roles = ["chief"] * chief + ["worker"] * workers + ["ps"] * ps
    on_host = _host_of_each(roles, hosts.count) if hosts else [None] * len(roles)
    if hosts:
        ports = [_FIRST_PORT + on_host[:i].count(host) for i, host in enumerate(on_host)]
        addresses = [f"{hosts.addresses[host]}:{port}" for host, port in zip(on_host, ports)]
    else:
        addresses = [f"127.0.0.1:{port}" for port in free_loopback_ports(len(roles))]
    cluster = cluster_of(roles, addresses)
    tasks = []
    for role, host in zip(roles, on_host):
        index = sum(task.role == role for task in tasks)
        tf_config = json.dumps({"cluster": cluster, "task": {"type": role, "index": index}})
        reports = role == "chief" or (not chief and role == "worker" and index == 0)
        # Under a parameter-server chief, workers and parameter servers serve until stopped.
        finishes = not processes.coordinated or role == "chief"
        runs = train if finishes else serve
        tasks.append(Task(role, index, hosts.command(host, runs) if hosts else runs, {**env, "TF_CONFIG": tf_config},
                          reports, finishes))
    return tasks


_FIRST_PORT = 2222  # on a namespace host: every host has its own ports, all free


def _host_of_each(roles: list[str], hosts: int) -> list[int]:
    """The host of each task (`roles` lists the parameter servers last): parameter servers on the last
    hosts, one each, so that what they serve crosses a link; the chief and workers round-robin over
    the others.

    Raises:
      ConfigError: too few hosts for the parameter servers and one more, or more hosts than tasks.
    """
    servers = roles.count("ps")
    if hosts > len(roles):
        raise ConfigError("--hosts", f"must be at most the job's {len(roles)} tasks ({', '.join(roles)}).", hosts)
    if servers and hosts < servers + 1:
        raise ConfigError("--hosts", f"must be at least {servers + 1}: each parameter server on a host of its own, "
                          "and one for the chief and workers.", hosts)
    others = hosts - servers
    return [i % others for i in range(len(roles) - servers)] + list(range(others, hosts))


def _horovod_hosts(ranks: int, hosts: Optional[NamespaceHosts]) -> list[str]:
    """horovodrun's host flags: every rank on this machine, or spread over the namespace hosts (whose
    sshd it reaches them by; Gloo and the rendezvous use the hosts' interface)."""
    if not hosts:
        return ["-H", f"localhost:{ranks}"]
    if hosts.count > ranks:
        raise ConfigError("--hosts", f"must be at most the job's {ranks} Horovod ranks (--workers).", hosts.count)
    slots = [ranks // hosts.count + (i < ranks % hosts.count) for i in range(hosts.count)]
    return ["-H", ",".join(f"{address}:{n}" for address, n in zip(hosts.addresses, slots)),
            "--network-interface", hosts.tag, "--ssh-identity-file", hosts.start_ssh()]


def run(tasks: list[Task], *, max_restarts: int = 0, replan: Optional[Callable[[], list[Task]]] = None,
        hosts: Optional[NamespaceHosts] = None, stalled_seconds: float = STALLED_SECONDS, out: TextIO = sys.stdout,
        err: TextIO = sys.stderr) -> int:
    """Runs every task until the job is done or one fails; returns the exit code.

    Args:
      tasks: the job's tasks.
      max_restarts: run the whole job again after a failure, up to this many
        times (a job with `checkpoint.dir` resumes from its last checkpoint).
        A preemption (a task exits 75 after saving) is restarted too, with any
        max_restarts above 0, and does not use one up (up to MAX_PREEMPTIONS).
        A stop by SIGINT or SIGTERM of the launcher is not restarted.
      replan: the tasks of a restart (fresh ports), when given.
      hosts: the namespace hosts the tasks run on, if any (what runs in them is part of the job).
      stalled_seconds: a task stopped (SIGSTOP) this long ends the job, naming it.
    """
    failures = preemptions = 0
    while True:
        job = _Job(tasks, out, err, hosts, stalled_seconds)
        code = job.run()
        preempted = code == EXIT_PREEMPTED and preemptions < MAX_PREEMPTIONS
        if code == 0 or job.signalled is not None or not max_restarts or (
                not preempted and failures == max_restarts):
            return code
        if preempted:
            preemptions += 1
            job.say(f"restarting the job after a preemption ({preemptions}; preemptions do not count as "
                    f"failures): {job.failure}")
        else:
            failures += 1
            job.say(f"restarting the job ({failures} of {max_restarts}) after: {job.failure}")
        tasks = replan() if replan else tasks


def exit_code(returncode: int) -> int:
    """A shell's exit code for a process's return code (signal N: 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


class _Job:
    def __init__(self, tasks: list[Task], out: TextIO, err: TextIO, hosts: Optional[NamespaceHosts],
                 stalled_seconds: float = STALLED_SECONDS):
        self.tasks = tasks
        self.hosts = hosts
        self.stalled_seconds = stalled_seconds
        self.out, self.err = out, err
        self.processes: list[subprocess.Popen] = []
        self.pumps: list[threading.Thread] = []
        self.write_lock = threading.Lock()
        self.signalled: Optional[int] = None
        self.horovod_failures: list[tuple[int, int]] = []  # (rank, code), in the order horovodrun reports them
        self.ranks_that_lost_a_peer: set[int] = set()  # they failed because another rank did
        self.mid_line = False  # the last output ended without a newline (a progress bar)
        self.exits: queue.Queue = queue.Queue()  # (task, return code), as each task exits
        self.failure: Optional[str] = None  # what failed, as the one line says it
        self.preempted: list[str] = []  # the tasks that said they got SIGTERM
        self.stopped_since: dict[str, float] = {}  # task -> when it was first seen stopped (SIGSTOP)
        self.last_stall_check = 0.0

    def run(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            for task in self.tasks:
                self._start(task)
            return self._watch()
        finally:
            self._stop()
            if self.hosts:
                self.hosts.stop_tasks()
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _start(self, task: Task) -> None:
        # On a terminal, the reporting task writes to one too (a pseudo-terminal), so Keras draws
        # its progress bar in place with carriage returns instead of a line per update.
        terminal = task.reports and task.role != "horovodrun" and _isatty(self.out)
        reader, writer = pty.openpty() if terminal else (None, subprocess.PIPE)
        # Its own session, so a signal meant for the launcher reaches each task once, from here,
        # and stopping a task stops what it started (horovodrun's ranks). Its guard ends it if the
        # launcher dies without stopping it (SIGKILL).
        process = subprocess.Popen(guard.command(task.command), env=task.env, stdin=subprocess.DEVNULL,
                                   stdout=writer, stderr=subprocess.PIPE, start_new_session=True)
        if terminal:
            os.close(writer)
        self.processes.append(process)
        threading.Thread(target=lambda: self.exits.put((task, process.wait())), daemon=True).start()
        stdout = os.fdopen(reader, "rb", buffering=0) if terminal else process.stdout
        self._pump(task, stdout, self.out, raw=task.reports)
        self._pump(task, process.stderr, self.err, raw=False)

    def _watch(self) -> int:
        # Exits in the order they happened: a killed worker's peer fails moments after it, and must
        # not be named as the first to fail just because it comes first in the task list.
        unfinished = {task.name for task in self.tasks if task.finishes}
        while unfinished:
            if self.signalled is not None:
                self._stop()  # first, so that the tasks' last lines come before this one
                self.say(f"stopped by {signal.Signals(self.signalled).name}; stopped every task")
                return 128 + self.signalled
            try:
                task, code = self.exits.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                stalled = self._stalled()
                if stalled:
                    self._stop(grace=FAILED_JOB_GRACE_SECONDS)
                    self.failure = f"{stalled} has been stopped (SIGSTOP) for {self.stalled_seconds:g} s, which " \
                                   "stalls the job; stopped every task"
                    self.say(f"error: {self.failure}")
                    return 1
                continue
            if code:
                stopped = self._stopped_tasks()  # before the others are stopped too
                self._stop(grace=FAILED_JOB_GRACE_SECONDS)  # and the output still in the pipes, before the one line
                self.failure, code = self._failure(task, code, stopped)
                self.say(f"error: {self.failure}")
                return exit_code(code)
            unfinished.discard(task.name)
        return 0

    def _failure(self, task: Task, code: int, stopped: list[str]) -> tuple[str, int]:
        """The one line for a failed task, and the exit code to end with (the failed rank's, under Horovod).

        A task that is stopped (SIGSTOP) is named first: the one that failed was waiting for it. A
        preemption names the tasks that got SIGTERM, not the first to exit 75 after them.
        """
        name, stop = task.name, "stopped the other tasks"
        if task.role == "horovodrun" and self.horovod_failures:
            # The first rank to fail by itself: a rank that saw its peer go can exit before horovodrun reaps
            # the killed peer, and horovodrun reports whichever exited first.
            causes = [f for f in self.horovod_failures if f[0] not in self.ranks_that_lost_a_peer]
            rank, code = (causes or self.horovod_failures)[0]
            name, stop = f"rank {rank}", "horovodrun stopped the other ranks"
        if stopped:
            return f"{' and '.join(stopped)} stopped (SIGSTOP) and stalled the job: {name} failed waiting " \
                   f"({_describe(code)}); {stop}", code
        if code == EXIT_PREEMPTED and self.preempted:
            return f"{' and '.join(self.preempted)} preempted (SIGTERM): every task saved the checkpoint and " \
                   f"exited {code}; {stop}", code
        if code == EXIT_TERMINATED and self.preempted:
            return f"{' and '.join(self.preempted)} stopped by SIGTERM: every task stopped at the same step and " \
                   f"exited {code} (no checkpoint.dir: nothing saved); {stop}", code
        return f"{name} failed ({_describe(code)}); {stop}", code

    def _stopped_tasks(self) -> list[str]:
        """The tasks (under Horovod, the ranks) with a process stopped by a signal."""
        names = []
        for task, process in zip(self.tasks, self.processes):
            if process.poll() is not None:
                continue
            pids = process_tree.descendants(process.pid)
            if task.role == "horovodrun" and self.hosts:
                pids += self.hosts.pids()  # ranks on namespace hosts are their sshd's children
            for pid in pids:
                if process_tree.is_stopped(pid):
                    rank = process_tree.horovod_rank(pid) if task.role == "horovodrun" else None
                    name = task.name if rank is None else f"rank {rank}"
                    names += [name] * (name not in names)
        return names

    def _stalled(self) -> Optional[str]:
        """A task stopped for `stalled_seconds`, if any (checked about once a second)."""
        now = time.monotonic()
        if now - self.last_stall_check < 1.0:
            return None
        self.last_stall_check = now
        stopped = self._stopped_tasks()
        self.stopped_since = {name: self.stopped_since.get(name, now) for name in stopped}
        stalled = [name for name, since in self.stopped_since.items() if now - since >= self.stalled_seconds]
        return " and ".join(stalled) or None

    def say(self, message: str) -> None:
        with self.write_lock:
            if self.mid_line:  # below a progress bar, not on it
                self.out.write("\n")
            self.out.flush()
            print(f"tfdist launch: {message}", file=self.err, flush=True)

    def _on_signal(self, signum, frame) -> None:
        self.signalled = signum

    def _stop(self, grace: float = STOP_GRACE_SECONDS) -> None:
        """SIGTERM to every task's process group still running, SIGKILL after `grace` seconds
        (horovodrun always gets STOP_GRACE_SECONDS, to stop its ranks)."""
        live = [(t, p) for t, p in zip(self.tasks, self.processes) if p.poll() is None]
        for _, process in live:
            _signal_group(process, signal.SIGTERM)
            _signal_group(process, signal.SIGCONT)  # a stopped task cannot act on SIGTERM
        start = time.monotonic()
        for task, process in live:
            allowed = STOP_GRACE_SECONDS if task.role == "horovodrun" else grace
            try:
                process.wait(timeout=max(0.1, start + allowed - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(process, signal.SIGKILL)
                process.wait()
        for process in self.processes:
            _signal_group(process, signal.SIGKILL)  # anything a task left behind in its group
        for pump in self.pumps:
            pump.join(timeout=STOP_GRACE_SECONDS)

    def _pump(self, task: Task, stream, sink: TextIO, *, raw: bool) -> None:
        """Copies `stream` to `sink`: as it comes when `raw` (carriage returns and all), else by prefixed lines."""

        def pump():
            with stream:
                if raw and task.role != "horovodrun":
                    for chunk in iter(lambda: _read(stream), b""):
                        self._write(sink, chunk.decode(errors="replace"))
                    return
                for line in iter(stream.readline, b""):
                    text = self._label(task, line.decode(errors="replace"))
                    if text is not None:
                        self._write(sink, text)

        thread = threading.Thread(target=pump, name=f"tfdist-launch-{task.name}", daemon=True)
        thread.start()
        self.pumps.append(thread)

    def _label(self, task: Task, line: str) -> Optional[str]:
        """`line` as shown: prefixed with its task, or None to hold it back."""
        if task.role != "horovodrun":
            self._note_preemption(task.name, line)
            return f"[{task.name}] {line}"
        # horovodrun starts each segment of a rank's output (up to a newline or carriage return)
        # with its prefix; what precedes the first prefix is horovodrun's own.
        own, *segments = _HOROVOD_PREFIX.split(line)
        failure = _HOROVOD_FAILURE.match(own)
        if failure:  # kept for the one line; the traceback after them is not
            self.horovod_failures.append((int(failure.group(1)), int(failure.group(2))))
        shown = []
        for rank, stream, text in zip(segments[::3], segments[1::3], segments[2::3]):
            self._note_preemption(f"rank {rank}", text)
            if PEER_LOST_UNDER_HOROVOD in text:
                self.ranks_that_lost_a_peer.add(int(rank))
            shown.append(text if rank == "0" and stream == "stdout" else f"[rank {rank}] {text}")
        return "".join(shown) or None

    def _note_preemption(self, name: str, line: str) -> None:
        if line.startswith(SIGTERM_RECEIVED) and name not in self.preempted:
            self.preempted.append(name)

    def _write(self, sink: TextIO, text: str) -> None:
        with self.write_lock:
            sink.write(text)
            sink.flush()
            if sink is self.out and text:
                self.mid_line = not text.endswith("\n")


def _isatty(stream: TextIO) -> bool:
    return hasattr(stream, "isatty") and stream.isatty()


def _read(stream) -> bytes:
    """What `stream` has now (up to 4 KiB), waiting only while it has nothing; b"" at its end."""
    try:
        return (stream.read1 if hasattr(stream, "read1") else stream.read)(4096) or b""
    except OSError:  # a pseudo-terminal whose writer has gone: end of output
        return b""


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(process.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _describe(code: int) -> str:
    if code == EXIT_PREEMPTED:
        return f"exit code {code}: preempted, its checkpoint saved"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    if code > 128 and code - 128 in signal.valid_signals():
        return f"exit code {code}, {signal.Signals(code - 128).name}"
    return f"exit code {code}"
