"""Parameter-server cluster tasks: serving one, and a whole local cluster on loopback.

On a real cluster every task runs `tfdist train`; workers and parameter servers
call `serve` and never return, the chief coordinates. On one machine
`LocalCluster` starts the workers and parameter servers as child processes on
127.0.0.1 and restarts a worker that dies (as Kubernetes would), so
ClusterCoordinator's worker fault tolerance does its job; a parameter server
that dies is left dead, and the chief's next step fails with a ClusterError.

Example:

    >>> with LocalCluster(num_workers=2, num_ps=1) as cluster:  # doctest: +SKIP
    ...     strategy = ParameterServerStrategy(cluster.resolver())
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from typing import Optional

from tfdist.errors import ClusterError
from tfdist.cluster.loopback import accepts_connections, free_loopback_ports, listens, port_holders, port_is_free
from tfdist.tf_startup import QUIET_LOG_LEVEL

__all__ = ["LocalCluster", "serve"]

START_TIMEOUT_SECONDS = 60
START_ATTEMPTS = 3  # on fresh ports each, when another process took one meanwhile
STOP_TIMEOUT_SECONDS = 10
CHIEF_POLL_SECONDS = 2.0
# A user's chief may listen for only a few seconds (a short script): looked for this often until it comes.
CHIEF_ARRIVAL_POLL_SECONDS = 0.1
PORT_HELD_GRACE_SECONDS = 10  # a dead worker's port held this long is taken, not a closing socket's wait


def serve(cluster_spec: dict, job: str, index: int, *, threads: int = 0) -> None:
    """Runs this process as task `job:index` of the cluster until it is killed."""
    import tensorflow as tf

    config = tf.compat.v1.ConfigProto()
    if threads:
        config.intra_op_parallelism_threads = threads
        config.inter_op_parallelism_threads = max(2, threads)
    server = tf.distribute.Server(
        tf.train.ClusterSpec(cluster_spec), job_name=job, task_index=index, protocol="grpc", config=config
    )
    if cluster_spec.get("chief"):
        threading.Thread(target=_exit_after_chief, args=(cluster_spec["chief"][0],), daemon=True).start()
    server.join()


def _exit_after_chief(address: str) -> None:
    """Ends this server (exit 0) once the chief has come and gone: under Slurm or Kubernetes a
    job's parameter servers and workers would otherwise outlive it forever."""
    while not accepts_connections(address):  # the chief starts after its servers
        time.sleep(CHIEF_ARRIVAL_POLL_SECONDS)
    misses = 0
    while misses < 3:  # three misses in a row: gone, not busy
        time.sleep(CHIEF_POLL_SECONDS)
        misses = 0 if accepts_connections(address) else misses + 1
    os._exit(0)


class LocalCluster:
    """Workers and parameter servers as child processes on loopback, plus the chief's address.

    Args:
      num_workers: worker processes.
      num_ps: parameter-server processes.
      threads: intra-op threads per task (0: TensorFlow decides).
      restart_workers: start a worker again, on the same port, when it dies.
    """

    def __init__(self, num_workers: int, num_ps: int, *, threads: int = 0, restart_workers: bool = True):
        self.num_workers, self.num_ps = num_workers, num_ps
        self.cluster_spec = self._fresh_cluster_spec()
        self.threads = threads
        self.restart_workers = restart_workers
        self.processes: dict[tuple[str, int], subprocess.Popen] = {}
        self.restarts = 0
        self.lost_workers: set[int] = set()  # workers not restarted: another process holds their port
        self._port_held_since: dict[int, float] = {}  # dead workers whose port was not free, since when
        self._stopping = threading.Event()
        self._supervisor: Optional[threading.Thread] = None

    def __enter__(self) -> "LocalCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _fresh_cluster_spec(self) -> dict[str, list[str]]:
        addresses = [f"127.0.0.1:{p}" for p in free_loopback_ports(1 + self.num_workers + self.num_ps)]
        return {
            "chief": addresses[:1],
            "worker": addresses[1 : 1 + self.num_workers],
            "ps": addresses[1 + self.num_workers :],
        }

    def start(self) -> None:
        for attempt in range(1, START_ATTEMPTS + 1):
            for job in ("ps", "worker"):
                for index in range(len(self.cluster_spec[job])):
                    self._spawn(job, index)
            try:
                self.wait_until_listening()
                break
            except _PortTaken as taken:
                if attempt == START_ATTEMPTS:
                    raise
                print(f"tfdist: {taken}; starting the local cluster again on other ports", file=sys.stderr, flush=True)
                self.cluster_spec = self._fresh_cluster_spec()
        self._stopping.clear()  # set by the failed attempt's stop
        self._supervisor = threading.Thread(target=self._supervise, name="tfdist-ps-supervisor", daemon=True)
        self._supervisor.start()

    def resolver(self):
        import tensorflow as tf

        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(self.cluster_spec), task_type="chief", task_id=0, rpc_layer="grpc"
        )

    def kill(self, job: str, index: int) -> None:
        """Kills one task with SIGKILL (for fault-tolerance tests)."""
        self.processes[(job, index)].kill()

    def stop(self) -> None:
        self._stopping.set()
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_SECONDS
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._supervisor is not None:
            self._supervisor.join(timeout=STOP_TIMEOUT_SECONDS)

    def _spawn(self, job: str, index: int) -> None:
        command = [
            sys.executable, "-c", "import sys, json; from tfdist.tf_startup import import_tensorflow; "
            "import_tensorflow(); from tfdist.cluster.servers import serve; "
            "serve(json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]), threads=int(sys.argv[4]))",
            json.dumps(self.cluster_spec), job, str(index), str(self.threads),
        ]
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", QUIET_LOG_LEVEL)}
        env.pop("TF_CONFIG", None)
        self.processes[(job, index)] = subprocess.Popen(
            command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, preexec_fn=_die_with_parent
        )

    def wait_until_listening(self) -> None:
        """Every task listens on its own port, or a ClusterError naming the ones that do not.

        The listener must be the task itself: a port taken meanwhile by another process (another
        job's task, in CI) accepts connections too, and the chief would then talk to a stranger."""
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        pending = {(job, i): self._port(job, i) for job in ("ps", "worker") for i in range(len(self.cluster_spec[job]))}
        while pending and time.monotonic() < deadline:
            for task, port in list(pending.items()):
                process = self.processes[task]
                if process.poll() is not None:
                    self.stop()
                    if not port_is_free(port):
                        raise _PortTaken(f"another process took port {port} of local {task[0]} {task[1]}")
                    raise ClusterError(f"local {task[0]} {task[1]} exited at start-up (code {process.returncode}).")
                if listens(process.pid, port):
                    del pending[task]
            time.sleep(0.2)
        if pending:
            self.stop()
            names = ", ".join(f"{job} {i}" for job, i in pending)
            raise ClusterError(f"local tasks did not start within {START_TIMEOUT_SECONDS} s: {names}.")

    def _port(self, job: str, index: int) -> int:
        return int(self.cluster_spec[job][index].rsplit(":", 1)[1])

    def _supervise(self) -> None:
        while not self._stopping.wait(0.5):
            self._restart_dead_workers()

    def _restart_dead_workers(self) -> None:
        """Starts each worker that died again on its port, or says once that it cannot: a port another
        process took since would make the new worker exit at once, again and again."""
        for (job, index), process in list(self.processes.items()):
            # A worker that exited 0 saw its chief finish (see `serve`): nothing to restart.
            if job != "worker" or not self.restart_workers or index in self.lost_workers or \
                    process.poll() in (None, 0):
                continue
            port = self._port(job, index)
            if not port_is_free(port, reuse_address=True):  # as gRPC binds: a closed connection's wait is no owner
                held_since = self._port_held_since.setdefault(index, time.monotonic())
                if time.monotonic() - held_since < PORT_HELD_GRACE_SECONDS:
                    continue
                self.lost_workers.add(index)
                print(f"tfdist: local worker {index} exited (code {process.returncode}) and another process holds "
                      f"its port {port} ({port_holders(port)}); not restarting it; its steps run on the others",
                      file=sys.stderr, flush=True)
                continue
            self._port_held_since.pop(index, None)
            self.restarts += 1
            print(f"tfdist: local worker {index} exited (code {process.returncode}); restarting it; "
                  "its steps run on the others meanwhile", file=sys.stderr, flush=True)
            self._spawn(job, index)


class _PortTaken(ClusterError):
    """A task could not listen: another process had taken its port since it was chosen."""


def _die_with_parent() -> None:
    """In the child: SIGKILL when the chief exits, so no server outlives it (Linux prctl)."""
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
