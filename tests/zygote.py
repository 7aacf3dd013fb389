"""The test zygote: one process that has imported TensorFlow, Keras and tfdist forks the Python processes tests start.

A fresh interpreter spends 4-6 CPU-seconds importing TensorFlow and Keras before it does
anything; most of the suite's processes are short jobs, so that import was about 40% of the
suite's CPU. The zygote imports them once, before any TensorFlow runtime exists (no device,
no thread pool, no session), and forks a child per command. A test runs `python ARGS` as
`python -I -S zygote_client.py ARGS` (`command` rewrites it; `run` and `Popen` are
`subprocess`'s with that done): the client is a real process that hands the zygote its
arguments, directory, environment, CPU affinity, niceness and standard streams, and the child,
set up as a new interpreter would be, runs the module, script or code as `__main__`. It ends as
the interpreter does (threads joined, atexit handlers run, streams flushed) but without freeing
its modules one by one, which in a child copies most of the heap (about 1 CPU-second). Because
the client is what the test holds, its pid, command line and environment in /proc, its exit code
and its pipes are those of the process it stands for; signals it receives go to the child
(SIGKILL kills the child through the zygote; SIGSTOP stops only the client, so a test that stops
a process, or a launcher that looks for stopped tasks, runs real ones). The Python processes a
child starts (a launcher's tasks, a benchmark's jobs, horovodrun's ranks) fork from the zygote
the same way, and so does horovodrun, a Python script (`HOROVODRUN`).

Forking a process that has threads is safe only if no thread holds a lock the child needs.
After these imports the only other threads are OpenBLAS's idle workers (numpy's), which
OpenBLAS stops around fork() itself (pthread_atfork). tests/test_zygote.py checks that
children train with collectives and give a fresh process's weights, many in a row.

What a process reads while it imports TensorFlow, Keras and Python (oneDNN on or off, the log
level, the path: `IMPORT_TIME_VARIABLES`) is fixed in a zygote. A client with other values of
those variables is forked from a sibling zygote that imported with them (started on first use, at
most `MAX_SIBLINGS`); one with interpreter options becomes the real interpreter. A client with
`TFDIST_TEST_WITHOUT_TFDIST=1` is forked from a sibling that imported TensorFlow and Keras and never tfdist
(itself forked from the zygote before that imports tfdist): a reference computed there never saw tfdist. A script that
sets such a variable itself before importing TensorFlow must not be run through the zygote. A
client in another network namespace (a task on a namespace host) sends it along with its mount
namespace, and its child joins both (setns) before it runs: it is on that host as the client is.

    import zygote
    done = zygote.run([sys.executable, "-m", "tfdist.cli", "train"], capture_output=True, text=True, timeout=300)
"""

from __future__ import annotations

import atexit
import io
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile

from zygote_client import SOCKET_VARIABLE, has_interpreter_options, network_namespace, receive, send

OFF_VARIABLE = "TFDIST_TEST_ZYGOTE_OFF"  # =1: every process starts for real
REFUSALS_VARIABLE = "TFDIST_TEST_ZYGOTE_REFUSALS"  # a file: each refusal, a JSON line (why, and the program)
FORKS_VARIABLE = "TFDIST_TEST_ZYGOTE_FORKS"  # a file: each child, a JSON line (its PID, test and program)
# =1: forked from a zygote that imported TensorFlow and Keras but never tfdist (a reference that never saw it).
WITHOUT_TFDIST_VARIABLE = "TFDIST_TEST_WITHOUT_TFDIST"

CLIENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zygote_client.py")
# What a process reads once while it imports TensorFlow, Keras and Python: a child must share them.
IMPORT_TIME_VARIABLES = ("TF_CPP_MIN_LOG_LEVEL", "TF_ENABLE_ONEDNN_OPTS", "KERAS_BACKEND", "KERAS_HOME",
                         "TF_CPP_MAX_VLOG_LEVEL", "TF_USE_LEGACY_KERAS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                         "PYTHONPATH", "PYTHONHASHSEED", "PYTHONFAULTHANDLER", "PYTHONWARNINGS", "PYTHONIOENCODING",
                         "PYTHONUTF8", "PYTHONOPTIMIZE", "PYTHONDEVMODE", WITHOUT_TFDIST_VARIABLE)


def _import_time_values(env: dict) -> dict:
    return {name: env.get(name) for name in IMPORT_TIME_VARIABLES}


def _values_at_import(request: dict) -> dict:
    """The values of `IMPORT_TIME_VARIABLES` when the request's program imports TensorFlow: its environment's,
    but tfdist's command line sets the log level itself where it is unset (`quiet_tensorflow_log`)."""
    values = _import_time_values(request["env"])
    if values["TF_CPP_MIN_LOG_LEVEL"] is None and request["argv"][:2] == ["-m", "tfdist.cli"]:
        from tfdist.tf_startup import QUIET_LOG_LEVEL  # here: a zygote without tfdist never imports it

        values["TF_CPP_MIN_LOG_LEVEL"] = QUIET_LOG_LEVEL
    return values


# ----------------------------------------------------------------------------- the zygote's side

def _refusal(request: dict, values: dict) -> str | None:
    """Why no zygote can stand in for this request's interpreter (`values`: its import-time values), or None."""
    if request["python"] != sys.executable:
        return f"another interpreter ({request['python']})"
    if has_interpreter_options(request["argv"]):
        return "interpreter options"
    unset = [k for k, v in values.items() if v is None and k in os.environ]
    if unset:  # the program may choose them itself before it imports TensorFlow
        return f"variables read at import are unset: {unset}"
    return None


# Zygotes of other import-time values; each holds a few hundred MB. A pytest worker's tests had made 4 (one of
# them oneDNN on, for the activation peaks) by the time test_zygote.py asked for the two it checks.
MAX_SIBLINGS = 8


class _Siblings:
    """Zygotes that imported with other values of the variables read at import (a benchmark's jobs run with
    OMP_NUM_THREADS=1, a scenario without oneDNN): the first request with such values starts one, and later
    requests with them are sent to it. Started only by the test's own zygote, which they die with."""

    def __init__(self, directory: str):
        self.directory = directory
        self.paths: dict[str, str] = {}  # import-time values (JSON) -> that zygote's socket

    def path_for(self, values: dict) -> str | None:
        """The socket of the zygote that imported with `values`, started now if need be; None past the limit."""
        key = json.dumps(values, sort_keys=True)
        if key not in self.paths and len(self.paths) < MAX_SIBLINGS:
            path = os.path.join(self.directory, f"sibling-{len(self.paths)}")
            listener = _listening(path)  # bound before the import: clients queue on it meanwhile
            env = {k: v for k, v in os.environ.items() if k not in values}
            env.update({k: v for k, v in values.items() if v is not None})
            subprocess.Popen([sys.executable, os.path.abspath(__file__), "--listener", str(listener.fileno())],
                             pass_fds=[listener.fileno()], env=env, stdin=subprocess.DEVNULL)
            listener.close()  # the sibling's now: if it dies at start-up, its queued clients see the socket close
            self.paths[key] = path
        return self.paths.get(key)

    def fork_without_tfdist(self, zygotes_listener: socket.socket) -> None:
        """The sibling for clients that never see tfdist, forked from this zygote once it imported TensorFlow and
        Keras and before it imports tfdist: it shares those imports instead of making its own (4-5 CPU-seconds).
        A client whose other import-time values differ from this zygote's gets a sibling of its own, started."""
        values = {**_import_time_values(os.environ), WITHOUT_TFDIST_VARIABLE: "1"}
        path = os.path.join(self.directory, f"sibling-{len(self.paths)}")
        listener = _listening(path)
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            zygotes_listener.close()
            os.environ[WITHOUT_TFDIST_VARIABLE] = "1"
            _die_with_parent()
            _serve(listener, None)
        listener.close()
        self.paths[json.dumps(values, sort_keys=True)] = path

    def child_of(self, client: int) -> int | None:
        for path in self.paths.values():
            try:
                pid = _ask_at(path, client).get("pid")
            except (OSError, EOFError):  # a sibling that died starting: its clients have seen it
                continue
            if pid:
                return pid
        return None


def _listening(path: str) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    return listener


def _serve(listener: socket.socket, siblings: _Siblings | None) -> None:
    """Forks a child per client until told to stop; reports each child's exit to its client, and kills a child
    whose client has gone. A request with other import-time values goes to a sibling (`siblings`), or is
    refused where there are none (in a sibling)."""
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
            pid = child_of.get(request["child_of"])
            if pid is None and siblings and request["child_of"]:
                pid = siblings.child_of(request["child_of"])
            _send_quietly(connection, {"pid": pid, "refusals": refusals[-5:]})
            connection.close()
            continue
        values = _values_at_import(request)
        refusal = _refusal(request, values)
        elsewhere = None  # where the request goes instead of a child of this zygote
        if not refusal and values != _import_time_values(os.environ):
            sibling = siblings.path_for(values) if siblings else None
            if sibling:
                elsewhere = {"redirect": sibling}
            else:
                refusal = f"variables read at import differ, and no sibling zygote has them: {values}"
        if refusal:
            refusals.append(refusal)
            _log(REFUSALS_VARIABLE, {"refusal": refusal, "argv": request["argv"][:3]})
            elsewhere = {"refused": refusal}
        if elsewhere:
            _send_quietly(connection, elsewhere)
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
        test = request["env"].get("PYTEST_CURRENT_TEST")  # "FILE::NAME (PHASE)", inherited from the test's process
        _log(FORKS_VARIABLE, {"pid": pid, "test": test, "argv": [arg[:80] for arg in request["argv"][:3]]})


def _log(variable: str, record: dict) -> None:
    """Appends the record to the file `variable` names, if set (`make test`'s summary reads them)."""
    path = os.environ.get(variable)
    if path:
        with open(path, "a", encoding="utf-8") as log:
            log.write(json.dumps(record) + "\n")


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
    streams, namespaces = fds[:3], fds[3:]
    for target, fd in enumerate(streams):
        os.dup2(fd, target)
        os.close(fd)
    try:
        if request["network"] != network_namespace():
            _join_namespaces(namespaces)
    except OSError as error:  # the child must not go back to the zygote's loop
        os.write(2, f"tfdist test zygote: {error}\n".encode())
        os._exit(127)
    for fd in namespaces:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.sched_setaffinity(0, request["affinity"])  # a new process has its parent's (a bench pins its jobs)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, request["nice"])  # and its niceness (Bazel's tests run at 19)
    except PermissionError:  # a higher priority than the zygote's, without the privilege
        pass
    _route_subprocesses()
    zygotes_streams = _standard_streams(unbuffered=bool(os.environ.get("PYTHONUNBUFFERED")))
    import numpy as np

    np.random.seed()  # as a new process would be; `random` reseeds itself after fork()
    try:
        _run_main(request)
        code = 0
    except SystemExit as exit_:
        code = _exit_code(exit_.code)
    except BaseException as error:  # noqa: BLE001  (what the interpreter does with an uncaught exception)
        sys.excepthook(type(error), error, error.__traceback__)
        code = -signal.SIGINT if isinstance(error, KeyboardInterrupt) else 1
    _shut_down(code, zygotes_streams)


def _join_namespaces(namespaces: list[int]) -> None:
    """Moves this process (one thread, just forked) into the client's network and mount namespaces."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    for fd, kind in zip(namespaces, (0x40000000, 0x00020000)):  # CLONE_NEWNET, CLONE_NEWNS
        if libc.setns(fd, kind) != 0:
            raise OSError(ctypes.get_errno(), "setns into the client's namespace failed")


def _run_main(request: dict) -> None:
    """Runs the module, code or script of `python ARGV` as `__main__`."""
    import runpy

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


def _exit_code(code) -> int:
    """The exit status of `sys.exit(code)`: a message is printed and exits 1."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def _shut_down(code: int, zygotes_streams: list) -> None:
    """The interpreter's shutdown as a program sees it (other threads joined, atexit handlers run, standard
    streams flushed), then the end, without freeing every module one by one: in a child that would write to,
    and so copy, most of the heap the zygote imported (about 1 CPU-second a process). So a file the program
    left open unflushed is not flushed, as after os._exit. The zygote's own standard streams are flushed too:
    a module imported in the zygote may hold them (a default argument `out=sys.stdout`), now on the child's
    descriptors."""
    import atexit
    import threading

    threading._shutdown()  # noqa: SLF001  (what Py_Finalize calls first: joins the non-daemon threads)
    atexit._run_exitfuncs()  # noqa: SLF001
    for stream in (sys.stdout, sys.stderr, *(s for s in zygotes_streams if not s.closed)):
        try:
            stream.flush()
        except (OSError, ValueError):
            code = code or 120  # as the interpreter exits when it cannot flush
    if code < 0:  # died of the signal, as the interpreter does after an uncaught KeyboardInterrupt
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


def _route_subprocesses() -> None:
    """In a child: the Python processes it starts (a launcher's tasks, a benchmark's jobs, horovodrun's ranks, a
    local cluster's servers) fork from the zygote too, by the same rewriting as a test's commands. The signals
    the child sends them go to the forked children themselves, so that a killed server is gone before its
    starter sees it end (a supervisor that restarts a server on its port must find the port free); and the
    check that a server's own pid holds its port is shown the forked child's pid."""
    start, signal_process = subprocess.Popen.__init__, subprocess.Popen.send_signal

    def routed_start(self, args, *more, **kwargs):
        if isinstance(args, (list, tuple)) and (kwargs.get("env") or os.environ).get(OFF_VARIABLE) != "1":
            routed = _routed(args)
            self._forked = routed != list(args)
            args = routed
        start(self, args, *more, **kwargs)

    def signal_forked_child(self, number):
        self.poll()
        child = _child_of(self.pid) if getattr(self, "_forked", False) and self.returncode is None else None
        if child is None:
            signal_process(self, number)
        else:
            _kill(child, number)

    subprocess.Popen.__init__, subprocess.Popen.send_signal = routed_start, signal_forked_child
    if os.environ.get(WITHOUT_TFDIST_VARIABLE) == "1":  # its program never imports tfdist's servers
        return
    from tfdist.cluster import servers

    listens = servers.listens
    servers.listens = lambda pid, port: listens(_child_of(pid) or pid, port)


def _child_of(client: int) -> int | None:
    """In a child: the pid of the forked child that stands for `client`, or None."""
    return _ask_at(os.environ[SOCKET_VARIABLE], client)["pid"]


def _standard_streams(unbuffered: bool) -> list:
    """sys.stdout and sys.stderr on the new descriptors 1 and 2, buffered as Python buffers them at start-up:
    stdout by line on a terminal and by block elsewhere, stderr by line, both written through if unbuffered.
    Returns the zygote's."""
    zygotes = [sys.stdout, sys.stderr]
    for fd, name in ((1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        binary = io.open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False)
        stream = io.TextIOWrapper(binary, encoding=old.encoding, errors=old.errors, write_through=unbuffered,
                                  line_buffering=not unbuffered and (fd == 2 or os.isatty(fd)))
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    return zygotes


def _tf_startup():
    """tfdist/tf_startup.py, loaded from its file on its own: importing it as `tfdist.tf_startup` would import the
    tfdist package, before the tfdist-free sibling is forked."""
    import importlib.util

    package = importlib.util.find_spec("tfdist").submodule_search_locations[0]
    spec = importlib.util.spec_from_file_location("_zygote_tf_startup", os.path.join(package, "tf_startup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _die_with_parent() -> None:
    import ctypes

    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _zygote_main(listener: socket.socket, ready_fd: int | None, siblings: _Siblings | None) -> None:
    _die_with_parent()  # the test process (a sibling's: the test's zygote)
    if os.environ.get(WITHOUT_TFDIST_VARIABLE) == "1":
        import tensorflow  # noqa: F401
        import keras  # noqa: F401
    else:
        _tf_startup().import_tensorflow()  # TensorFlow's start-up lines dropped, as tfdist's processes drop them
        import keras  # noqa: F401

        if siblings is not None:
            siblings.fork_without_tfdist(listener)
        import tfdist  # noqa: F401
        import tfdist.training  # noqa: F401  (not tfdist.cli: run as __main__, it would define its flags again)

    sys.stdout.flush()
    sys.stderr.flush()
    if ready_fd is not None:
        os.write(ready_fd, b"ready")
        os.close(ready_fd)
    _serve(listener, siblings)


# ----------------------------------------------------------------------------- the test's side

_zygote: subprocess.Popen | None = None
# The socket is named in the environment from the start (tests/conftest.py imports this module), so that
# every environment a test copies from os.environ has it; the zygote starts when a command first needs it.
# A socket's path has at most 107 characters: not under Bazel's long temporary directories.
# A process started by a test (which may import this module too) keeps its test's zygote; each pytest-xdist
# worker has its own (the workers inherit the environment of the controller, which imports this module too).
_WORKER_VARIABLE = "TFDIST_TEST_ZYGOTE_WORKER"  # the xdist worker whose zygote the socket is
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if __name__ != "__main__" and (SOCKET_VARIABLE not in os.environ or os.environ.get(_WORKER_VARIABLE) != _worker):
    os.environ[SOCKET_VARIABLE] = os.path.join(tempfile.mkdtemp(prefix="tfdist-zygote-", dir="/tmp"), "socket")
    os.environ[_WORKER_VARIABLE] = _worker
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
        _zygote.kill()  # and with it its siblings and any child still running (PR_SET_PDEATHSIG)
        _zygote.wait()
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def command(args):
    """`args` as it runs through the zygote: `[python, ARGS...]` -> `[python, -I, -S, zygote_client.py, ARGS...]`,
    also after a launcher (`[horovodrun, ..., python, ARGS...]`); other commands unchanged. Starts the zygote the
    first time."""
    if not isinstance(args, (list, tuple)) or os.environ.get(OFF_VARIABLE) == "1":
        return args
    routed = _routed(args)
    if routed != list(args) and _zygote is None and not os.path.exists(os.environ[SOCKET_VARIABLE]):
        _start()
    return routed


# horovodrun is a Python script, and checks that Horovod was built with Gloo in a forked child that imports
# TensorFlow (horovod.common.util._check_extension_lambda): 3-4 CPU-seconds a run, unless it runs forked from a
# zygote, whose children have TensorFlow imported already.
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")


def _routed(args) -> list:
    """`args` with each `python -m MODULE`, `python -c CODE` and `python SCRIPT` in it (also after a launcher
    such as horovodrun or a pinning wrapper), and horovodrun itself, run by the client instead."""
    routed = []
    for i, word in enumerate(args):
        following = str(args[i + 1]) if i + 1 < len(args) else "-"
        if word == sys.executable and (following in ("-m", "-c") or not following.startswith("-")):
            routed += [sys.executable, "-I", "-S", CLIENT]  # no interpreter options: those stay real
        elif word == HOROVODRUN:
            routed += [sys.executable, "-I", "-S", CLIENT, word]
        else:
            routed.append(word)
    return routed


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
    return _ask_at(path, pid)


def _ask_at(path: str, pid: int) -> dict:
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
    if sys.argv[1] == "--listener":  # a sibling, on the socket its zygote bound
        _zygote_main(socket.socket(fileno=int(sys.argv[2])), None, None)
    else:
        _zygote_main(_listening(sys.argv[1]), int(sys.argv[2]), _Siblings(os.path.dirname(sys.argv[1])))
