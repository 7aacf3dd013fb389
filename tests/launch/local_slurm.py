"""A real one-node Slurm for tests: munged, slurmctld and slurmd, all state in one directory.

Debian's slurm-wlm and munge (`make setup` installs them); the daemons run as
root and are stopped by the PIDs in their pid files. The jobs' Python tasks
fork from the test zygote (tests/startup/sitecustomize.py).
"""

import os
import signal
import socket
import subprocess
import time

CONF = """\
ClusterName=tfdist-test
SlurmctldHost=localhost(127.0.0.1)
AuthType=auth/munge
AuthInfo=socket={dir}/munge.socket
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
MpiDefault=none
SlurmUser=root
ReturnToService=2
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
NodeName={node} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""
START_TIMEOUT_SECONDS = 30
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
# The node is named as the usual one-node set-up names it, by its host name, so its tasks' addresses are
# `HOSTNAME:PORT`; tfdist accepts them where the name resolves only to loopback (it does here, in /etc/hosts).
NODE = socket.gethostname()
# On the jobs' PYTHONPATH: its sitecustomize has the test zygote fork the tasks slurmd starts.
ZYGOTE_STARTUP = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "startup")


class LocalSlurm:
    """`with LocalSlurm(directory) as slurm:` a running Slurm; `slurm.env` reaches it."""

    def __init__(self, directory, ctld_port, d_port):
        self.dir = str(directory)
        python_path = os.pathsep.join(filter(None, [ZYGOTE_STARTUP, os.environ.get("PYTHONPATH")]))
        self.env = {**os.environ, "SLURM_CONF": os.path.join(self.dir, "slurm.conf"), "PYTHONPATH": python_path}
        self.ports = (ctld_port, d_port)

    def __enter__(self):
        for sub in ("state", "spool"):
            os.makedirs(os.path.join(self.dir, sub), exist_ok=True)
        os.chmod(self.dir, 0o700)  # munged refuses a socket directory others can write
        with open(self.env["SLURM_CONF"], "w") as f:
            f.write(CONF.format(dir=self.dir, ctld_port=self.ports[0], d_port=self.ports[1], node=NODE))
        try:
            subprocess.run(["munged", "--force", f"--socket={self.dir}/munge.socket",
                            f"--pid-file={self.dir}/munged.pid", f"--log-file={self.dir}/munged.log",
                            f"--seed-file={self.dir}/munged.seed"], check=True, capture_output=True)
            for daemon in ("slurmctld", "slurmd"):
                subprocess.run([daemon], env=self.env, check=True, capture_output=True)
            self._wait_until_idle()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        for name in ("slurmd", "slurmctld", "munged"):
            try:
                with open(os.path.join(self.dir, f"{name}.pid")) as f:
                    os.kill(int(f.read().strip()), signal.SIGTERM)
            except (OSError, ValueError):
                continue

    def _wait_until_idle(self):
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            state = subprocess.run(["sinfo", "-h", "-o", "%t"], env=self.env, capture_output=True, text=True)
            if state.stdout.strip() == "idle":
                return
            time.sleep(0.5)
        raise RuntimeError(f"Slurm did not come up in {START_TIMEOUT_SECONDS} s: {self.log()}")

    def log(self):
        tails = []
        for name in ("slurmctld.log", "slurmd.log"):
            try:
                with open(os.path.join(self.dir, name)) as f:
                    tails.append(f.read()[-2000:])
            except OSError:
                pass
        return "\n".join(tails)

    def sbatch_wait(self, script, cwd, timeout):
        """Submits `script` and waits for the job; returns (its exit code, its output file's text)."""
        job = self.submit(script, cwd)
        code = self.wait(job, timeout)
        path = self.output_path(cwd, job)
        return code, open(path).read() if os.path.exists(path) else ""

    def submit(self, script, cwd):
        """Submits `script`; returns the job's id."""
        proc = subprocess.run(["sbatch", "--parsable"], input=script, text=True, capture_output=True, env=self.env,
                              cwd=cwd, check=True)
        return proc.stdout.strip().split(";")[0]

    def wait(self, job, timeout):
        """The job's exit code once it has ended (a requeued job has not). Polled every half second:
        `sbatch --wait` polls at growing intervals and returned 15-30 s after a short job ended."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            fields = self._fields(job)
            if fields.get("JobState") in ENDED:
                return int(fields["ExitCode"].split(":")[0])
            time.sleep(0.5)
        raise TimeoutError(f"Slurm job {job} did not end within {timeout} s: {self.log()}")

    def state(self, job):
        """The job's state and reason, e.g. `PENDING BeginTime`."""
        fields = self._fields(job)
        return f"{fields.get('JobState', '')} {fields.get('Reason', '')}".strip()

    def _fields(self, job):
        shown = subprocess.run(["scontrol", "show", "job", "-o", job], env=self.env, capture_output=True, text=True)
        return dict(part.split("=", 1) for part in shown.stdout.split() if "=" in part)

    @staticmethod
    def output_path(cwd, job):
        return os.path.join(cwd, f"tfdist-{job}.out")

    def start_now(self, job):
        """A requeued batch job waits before it may start again (about 2 minutes here): start it now.

        Not in the second its last run ended: slurmd revoked that run's credential then, and compares
        times in whole seconds, so a run started within it is refused ("Job credential revoked")."""
        time.sleep(2)
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=self.env, check=True,
                       capture_output=True)
