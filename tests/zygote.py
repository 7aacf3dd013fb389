"""The test zygote: one process that has imported TensorFlow, Keras and tfdist forks the Python processes tests start.

A fresh interpreter spends 4-6 CPU-seconds importing TensorFlow and Keras before it does
anything; most of the suite's processes are short jobs, so that import was about 40% of the
suite's CPU. The zygote imports them once, before any TensorFlow runtime exists (no device,
no thread pool, no session), and forks a child per command. A test runs `python ARGS` as
`python -I -S zygote_client.py ARGS` (`command` rewrites it; `run` and `Popen` are
`subprocess`'s with that done): the client is a real process that hands the zygote its
arguments, directory, environment and standard streams, and the child, set up as a new
interpreter would be, runs the module, script or code as `__main__` and exits through the
interpreter's own shutdown (atexit, thread joins). Because the client is what the test holds,
its pid, command line and environment in /proc, its exit code and its pipes are those of the
process it stands for; signals it receives go to the child (SIGKILL kills the child through the
zygote; SIGSTOP stops only the client, so a test that stops a process runs a real one).

Forking a process that has threads is safe only if no thread holds a lock the child needs.
After these imports the only other threads are OpenBLAS's idle workers (numpy's), which
OpenBLAS stops around fork() itself (pthread_atfork). tests/test_zygote.py checks that
children train with collectives and give a fresh process's weights, many in a row.

What a process reads while it imports TensorFlow, Keras and Python (oneDNN on or off, the log
level, the path: `IMPORT_TIME_VARIABLES`) is fixed in the zygote, and so is its network
namespace: a client whose values differ becomes the real interpreter instead. So does a command
with interpreter options. A script that sets such a variable itself before importing TensorFlow
must not be run through the zygote.

    import zygote
    done = zygote.run([sys.executable, "-m", "tfdist.cli", "train"], capture_output=True, text=True, timeout=300)
"""

from __future__ import annotations

import atexit
import io
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile

from zygote_client import SOCKET_VARIABLE, network_namespace, receive, send

CLIENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zygote_client.py")
# What a process reads once while it imports TensorFlow, Keras and Python: a child must share them.
IMPORT_TIME_VARIABLES = ("TF_CPP_MIN_LOG_LEVEL", "TF_ENABLE_ONEDNN_OPTS", "KERAS_BACKEND", "KERAS_HOME",
                         "TF_CPP_MAX_VLOG_LEVEL", "TF_USE_LEGACY_KERAS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                         "PYTHONPATH", "PYTHONHASHSEED", "PYTHONFAULTHANDLER", "PYTHONWARNINGS", "PYTHONIOENCODING",
                         "PYTHONUTF8", "PYTHONOPTIMIZE", "PYTHONDEVMODE")


def _import_time_values(env: dict) -> dict:
    return {name: env.get(name) for name in IMPORT_TIME_VARIABLES}


# ----------------------------------------------------------------------------- the zygote's side

def _refusal(request: dict) -> str | None:
    """Why the zygote cannot stand in for this request's interpreter, or None."""
    if request["python"] != sys.executable:
        return f"another interpreter ({request['python']})"
    if request["network"] != network_namespace():
        return "another network namespace"
    differing = {k: v for k, v in _import_time_values(request["env"]).items() if v != os.environ.get(k)}
    if differing:
        return f"variables read at import differ: {differing}"
    argv = request["argv"]
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-m", "-c")):
        return "interpreter options"
    return None


def _serve(listener: socket.socket) -> None:
    """Forks a child per client until told to stop; reports each child's exit to its client, and kills a child
    whose client has gone."""
    wake_reader, wake_writer = os.pipe()
    os.set_blocking(wake_writer, False)
    signal.set_wakeup_fd(wake_writer)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select below
    clients: dict[socket.socket, int] = {}  # a client's connection -> its child
    children: dict[int, socket.socket | None] = {}
    child_of: dict[int, int] = {}  # a client's pid -> its child's
    refusals: list[str] = []  # why, for the clients that became the real interpreter
    while True:
        ready = select.select([listener, wake_reader, *clients], [], [])[0]
        if wake_reader in ready:
            os.read(wake_reader, 4096)
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                connection = children.pop(pid)
                child_of.pop(next((c for c, p in child_of.items() if p == pid), None), None)
                if connection is not None:
                    clients.pop(connection, None)
                    _send_quietly(connection, {"returncode": os.waitstatus_to_exitcode(status)})
                    connection.close()
        for connection in [c for c in ready if c in clients]:
            try:
                message = receive(connection)
            except (EOFError, OSError):  # the client was killed: so is its child
                pid = clients.pop(connection)
                children[pid] = None
                connection.close()
                _kill(pid)
                continue
            _kill(clients[connection], message["signal"])
        if listener not in ready:
            continue
        connection, _ = listener.accept()
        try:
            request, fds = receive(connection, with_fds=True)
        except (EOFError, OSError):  # a client killed before it asked
            connection.close()
            continue
        if "child_of" in request:  # a test asks which child stands for a client
            for fd in fds:
                os.close(fd)
            _send_quietly(connection, {"pid": child_of.get(request["child_of"]), "refusals": refusals[-5:]})
            connection.close()
            continue
        refusal = _refusal(request)
        if refusal:
            refusals.append(refusal)
            _send_quietly(connection, {"refused": refusal})
            connection.close()
            for fd in fds:
                os.close(fd)
            continue
        pid = os.fork()
        if pid == 0:
            for fd in (wake_reader, wake_writer):
                os.close(fd)
            for other in (listener, connection, *clients):
                other.close()
            _become(request, fds)  # does not return
        for fd in fds:
            os.close(fd)
        clients[connection] = pid
        children[pid] = connection
        client_pid, _, _ = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        child_of[client_pid] = pid
        _send_quietly(connection, {"pid": pid})


def _send_quietly(connection: socket.socket, message: dict) -> None:
    try:
        send(connection, message)
    except OSError:  # the client has gone; its child is killed when the zygote reads that
        pass


def _kill(pid: int, number: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, number)
    except ProcessLookupError:
        pass


def _become(request: dict, fds: list[int]) -> None:
    """In the child: the process `python ARGV` would be, then run it as __main__."""
    _die_with_parent()  # the zygote: it outlives every client but at the end of the tests
    signal.set_wakeup_fd(-1)
    for number in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(number, signal.SIG_DFL)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _standard_streams(unbuffered=bool(os.environ.get("PYTHONUNBUFFERED")))
    import numpy as np
    import runpy

    np.random.seed()  # as a new process would be; `random` reseeds itself after fork()
    argv = request["argv"]
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = request["cwd"]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        sys.modules["__main__"] = main = type(sys)("__main__")
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")
    sys.exit(0)


def _standard_streams(unbuffered: bool) -> None:
    """sys.stdout and sys.stderr on the new descriptors 1 and 2, buffered as Python buffers them at start-up:
    stdout by line on a terminal and by block elsewhere, stderr by line, both written through if unbuffered."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        binary = io.open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False)
        stream = io.TextIOWrapper(binary, encoding=old.encoding, errors=old.errors, write_through=unbuffered,
                                  line_buffering=not unbuffered and (fd == 2 or os.isatty(fd)))
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _die_with_parent() -> None:
    import ctypes

    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _zygote_main(path: str, ready_fd: int) -> None:
    _die_with_parent()  # the test process
    from tfdist.tf_startup import import_tensorflow

    import_tensorflow()  # TensorFlow's start-up lines dropped, as tfdist's processes drop them
    import keras  # noqa: F401

    import tfdist  # noqa: F401
    import tfdist.training  # noqa: F401  (not tfdist.cli: run as __main__, it would define its flags again)

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(ready_fd, b"ready")
    os.close(ready_fd)
    _serve(listener)


# ----------------------------------------------------------------------------- the test's side

_zygote: subprocess.Popen | None = None
# The socket is named in the environment from the start (tests/conftest.py imports this module), so that
# every environment a test copies from os.environ has it; the zygote starts when a command first needs it.
# A socket's path has at most 107 characters: not under Bazel's long temporary directories.
# A process started by a test (which may import this module too) keeps its test's zygote.
if __name__ != "__main__" and SOCKET_VARIABLE not in os.environ:
    os.environ[SOCKET_VARIABLE] = os.path.join(tempfile.mkdtemp(prefix="tfdist-zygote-", dir="/tmp"), "socket")
    atexit.register(lambda: _stop(os.environ[SOCKET_VARIABLE]))


def _start() -> None:
    """Starts this test process's zygote, with its environment and the log level tests run with."""
    global _zygote
    path = os.environ[SOCKET_VARIABLE]
    reader, writer = os.pipe()
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}
    _zygote = subprocess.Popen([sys.executable, os.path.abspath(__file__), path, str(writer)], pass_fds=[writer],
                               env=env, stdin=subprocess.DEVNULL)
    os.close(writer)
    # An import starved at the lowest CPU priority beside pytest (Bazel's tests) takes minutes.
    if not select.select([reader], [], [], 600)[0] or os.read(reader, 5) != b"ready":
        _zygote.kill()
        raise RuntimeError("the test zygote did not start (its output is above)")
    os.close(reader)


def _stop(path: str) -> None:
    if _zygote is not None:
        _zygote.kill()  # and with it any child still running (PR_SET_PDEATHSIG)
        _zygote.wait()
    if os.path.exists(path):
        os.remove(path)
    os.rmdir(os.path.dirname(path))


def command(args):
    """`args` as it runs through the zygote: `[python, ARGS...]` -> `[python, -I, -S, zygote_client.py, ARGS...]`;
    other commands unchanged. Starts the zygote the first time."""
    if not (isinstance(args, (list, tuple)) and len(args) >= 2 and args[0] == sys.executable
            and (args[1] in ("-m", "-c") or not str(args[1]).startswith("-"))  # no interpreter options
            and os.environ.get("TFDIST_TEST_ZYGOTE_OFF") != "1"):
        return args
    if _zygote is None and not os.path.exists(os.environ[SOCKET_VARIABLE]):
        _start()
    return [sys.executable, "-I", "-S", CLIENT, *map(str, args[1:])]


def forked_child(pid: int) -> int | None:
    """The pid of the child that stands for client `pid`, or None (`pid` is a real process, or has ended)."""
    return _ask(pid)["pid"]


def refusals() -> list[str]:
    """Why the zygote's last few refusals were made (a test's message, when a command was not forked)."""
    return _ask(0)["refusals"]


def _ask(pid: int) -> dict:
    path = os.environ[SOCKET_VARIABLE]
    if _zygote is None or not os.path.exists(path):
        return {"pid": None, "refusals": ["this test process started no zygote"]}
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with connection:
        connection.connect(path)
        send(connection, {"child_of": pid})
        return receive(connection)


def send_signal(process: subprocess.Popen, number: int) -> None:
    """Sends signal `number` to the process `process` stands for: the forked child itself, so that even
    SIGKILL and SIGSTOP reach it at once, or the real process."""
    os.kill(forked_child(process.pid) or process.pid, number)


def run(args, **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run`, through the zygote where it can be."""
    return subprocess.run(command(args), **_with_socket(kwargs))


def Popen(args, **kwargs) -> subprocess.Popen:  # noqa: N802  (subprocess's name)
    """`subprocess.Popen`, through the zygote where it can be."""
    return subprocess.Popen(command(args), **_with_socket(kwargs))


def _with_socket(kwargs: dict) -> dict:
    """An `env` made before the socket was named (a module's constant) names it too."""
    if kwargs.get("env") is not None and SOCKET_VARIABLE not in kwargs["env"]:
        kwargs = {**kwargs, "env": {**kwargs["env"], SOCKET_VARIABLE: os.environ[SOCKET_VARIABLE]}}
    return kwargs


if __name__ == "__main__":
    _zygote_main(sys.argv[1], int(sys.argv[2]))
