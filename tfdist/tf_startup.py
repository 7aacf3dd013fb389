"""Importing TensorFlow without the lines its C++ prints before its logging starts.

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

__all__ = ["import_tensorflow"]

# absl's warning that precedes them, and info lines (glog format: I, month-day, time).
_STARTUP_LINE = re.compile(r"^(WARNING: All log messages before absl::InitializeLog\(\)|I\d{4} \d\d:\d\d:\d\d)")


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
