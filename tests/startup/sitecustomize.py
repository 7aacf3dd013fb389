"""The test zygote for Python processes that programs other than tfdist start: Slurm's tasks.

slurmd starts a batch job's tasks from the script `tfdist slurm` wrote, with the interpreter's
path in it, so a test cannot rewrite their command as it rewrites its own (tests/zygote.py). The
Slurm tests put this directory on the jobs' PYTHONPATH instead: Python imports this module as it
starts, before anything else, and it hands the process's arguments to the test zygote, which
forks the task; this process then stands in for it as `zygote_client.py` does (signals passed
on, the task's exit status its own). Where no zygote can stand in, start-up goes on as usual.
Its own entry leaves PYTHONPATH first: the zygote imported without it, and the task's own
Python processes go through the zygote the ordinary way.
"""

import os
import sys

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _stand_in() -> None:
    sys.path.insert(0, _TESTS)
    import zygote_client

    sys.path.remove(_TESTS)
    python_path = zygote_client.without_startup(os.environ).get("PYTHONPATH")
    if python_path:  # what this process starts, should it start for real, is not handed over again
        os.environ["PYTHONPATH"] = python_path
    else:
        os.environ.pop("PYTHONPATH", None)
    args = sys.orig_argv[1:]
    if zygote_client.has_interpreter_options(args):
        return  # the real interpreter (the zygote would refuse it)

    returncode = zygote_client.stand_in(args)
    if returncode is not None:  # the task ran, forked; SystemExit here would be a failed start-up
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(zygote_client.end_as(returncode))


_stand_in()
