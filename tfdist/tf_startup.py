"""TensorFlow's C++ log in tfdist's processes: off below FATAL, and its start-up lines dropped.

tfdist turns the failures a user meets (a lost peer, a lost parameter server, a
stalled task) into one line of its own. TensorFlow's C++ log would bury that line
under gRPC's detail: 6 error lines before a lost multi-worker peer's, 40-118 while
a restarted parameter-server worker reconnects. So tfdist's processes run with
TF_CPP_MIN_LOG_LEVEL=3 unless the user set it (0 shows everything, 2 errors).

TensorFlow 2.21's libraries log "oneDNN custom operations are on" (twice, each
after absl's "All log messages before absl::InitializeLog()" warning) while
they load, before TF_CPP_MIN_LOG_LEVEL applies. tfdist's processes import
TensorFlow here, with the stderr file descriptor captured, and pass on every
captured line but those, so a one-line error is the user's last screen.
With TF_CPP_MIN_LOG_LEVEL=0 (info wanted) nothing is filtered.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile

__all__ = ["QUIET_LOG_LEVEL", "import_tensorflow", "quiet_tensorflow_log"]

QUIET_LOG_LEVEL = "3"  # FATAL only

# absl's warning that precedes them, and info lines (glog format: I, month-day, time).
_STARTUP_LINE = re.compile(r"^(WARNING: All log messages before absl::InitializeLog\(\)|I\d{4} \d\d:\d\d:\d\d)")


def quiet_tensorflow_log() -> None:
    """TF_CPP_MIN_LOG_LEVEL=3 unless set, for this process and the ones it starts; before TensorFlow loads."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", QUIET_LOG_LEVEL)


def import_tensorflow() -> None:
    """Imports TensorFlow, dropping its start-up info lines unless TF_CPP_MIN_LOG_LEVEL is 0."""
    if "tensorflow" in sys.modules or os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0") in ("", "0"):
        import tensorflow  # noqa: F401
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            import tensorflow  # noqa: F401
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            for line in captured.read().decode(errors="replace").splitlines(keepends=True):
                if not _STARTUP_LINE.match(line):
                    sys.stderr.write(line)
