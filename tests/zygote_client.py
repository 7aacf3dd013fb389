"""`python ARGS` through the test zygote: run as `python -I -S zygote_client.py ARGS`.

This small process (standard library only, no site packages: it starts in a few
hundredths of a second) stands where the interpreter would. It hands the zygote
its arguments, working directory, environment and standard streams; the zygote
forks a child that runs `python ARGS` on them. The client passes on the signals
it gets (TERM, INT, HUP, QUIT, USR1, USR2, CONT), exits with the child's code (or
dies of the child's signal), and if the client is killed the zygote kills the
child. Where no zygote can stand in (none runs, interpreter options: see
tests/zygote.py), the client
becomes the real interpreter (exec) and nothing else changes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

SOCKET_VARIABLE = "TFDIST_TEST_ZYGOTE"  # the zygote's socket path, in every process a test starts
# On a PYTHONPATH, its sitecustomize hands the process to the zygote as it starts (Slurm's tasks); never in the
# environment a child gets: the zygotes imported without it.
STARTUP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "startup")
_HEADER = 8  # a message's length, as 8 decimal digits
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGCONT)


def send(connection: socket.socket, message: dict, fds=()) -> None:
    body = json.dumps(message).encode()
    data = b"%08d" % len(body) + body
    if fds:
        socket.send_fds(connection, [data], list(fds))
    else:
        connection.sendall(data)


def receive(connection: socket.socket, with_fds: bool = False):
    """One message, and with `with_fds` the descriptors sent with it; EOFError when the peer has gone."""
    fds = []
    if with_fds:
        data, fds, _, _ = socket.recv_fds(connection, 65536, len(SENT_FDS))
    else:
        data = connection.recv(_HEADER)
    if not data:
        raise EOFError
    while len(data) < _HEADER:
        data += _more(connection, _HEADER - len(data))
    length = int(data[:_HEADER])
    body = data[_HEADER:]
    while len(body) < length:
        body += _more(connection, length - len(body))
    message = json.loads(body)
    return (message, fds) if with_fds else message


def _more(connection: socket.socket, count: int) -> bytes:
    chunk = connection.recv(count)
    if not chunk:
        raise EOFError
    return chunk


def network_namespace() -> str:
    return os.readlink("/proc/self/ns/net")


# What a client sends the zygote: its standard streams, and its network and mount namespaces (a task on a
# namespace host runs in both: `ip netns exec` gives it the host's /etc/hosts in a mount namespace).
SENT_FDS = ("stdin", "stdout", "stderr", "/proc/self/ns/net", "/proc/self/ns/mnt")


def has_interpreter_options(args: list[str]) -> bool:
    """Whether `python ARGS` passes the interpreter options of its own (no zygote imported with them)."""
    return not args or (args[0].startswith("-") and args[0] not in ("-m", "-c"))


def _interpreter(args: list[str]) -> None:
    """Becomes `python ARGS`, the real interpreter."""
    os.execv(sys.executable, [sys.executable, *args])


def _forked(path: str, args: list[str]):
    """(connection, the child's pid) of the zygote at `path` that forked `python ARGS`, following its redirect to
    a sibling; None where neither stands in (refused, gone, or a sibling that died starting)."""
    request = {"argv": args, "cwd": os.getcwd(), "env": without_startup(os.environ), "python": sys.executable,
               "network": network_namespace(), "affinity": sorted(os.sched_getaffinity(0)),
               "nice": os.getpriority(os.PRIO_PROCESS, 0)}
    namespaces = [os.open(name, os.O_RDONLY) for name in SENT_FDS[3:]]
    for _ in range(2):  # the zygote, then the sibling it names
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.connect(path)
            send(connection, request, [0, 1, 2, *namespaces])
            reply = receive(connection)
        except (OSError, EOFError):
            connection.close()
            return None
        if "pid" in reply:
            return connection, reply["pid"]
        connection.close()
        if "redirect" not in reply:
            return None
        path = reply["redirect"]
    return None


def without_startup(env) -> dict:
    """`env` with `STARTUP` left out of its PYTHONPATH."""
    env = dict(env)
    paths = [path for path in env.pop("PYTHONPATH", "").split(os.pathsep) if path and os.path.abspath(path) != STARTUP]
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def _forward(connection: socket.socket, number: int) -> None:
    """Passes signal `number` on to the child; once the zygote has closed the connection the child has ended,
    and its exit status is what the client reports (a launcher's SIGTERM to every rank often comes then)."""
    try:
        send(connection, {"signal": number})
    except OSError:
        pass


def stand_in(args: list[str]) -> int | None:
    """Has the zygote fork `python ARGS` and stands in for it (signals passed on) until it ends; its exit
    status (-N: killed by signal N), or None where no zygote stands in."""
    path = os.environ.get(SOCKET_VARIABLE)
    forked = _forked(path, args) if path and os.path.exists(path) else None
    if forked is None:
        return None
    connection, child = forked
    for number in FORWARDED:
        signal.signal(number, lambda number, _: _forward(connection, number))
    try:
        return receive(connection)["returncode"]
    except EOFError:
        print(f"tfdist test zygote: the zygote ended before its child {child} did", file=sys.stderr)
        return 1


def end_as(returncode: int) -> int:
    """Dies of the child's signal, as its parent would see it; else returns its exit code."""
    if returncode < 0:
        if -returncode not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -returncode)
    return returncode


def main(args: list[str]) -> None:
    returncode = stand_in(args)
    if returncode is None:
        _interpreter(args)
    sys.exit(end_as(returncode))


if __name__ == "__main__":
    main(sys.argv[1:])
