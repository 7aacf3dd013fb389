"""Whether Horovod's collectives are down: what turns a failed step into "a rank was lost"."""

from __future__ import annotations

import threading

import tensorflow as tf

__all__ = ["collectives_are_down"]

_PROBE_SECONDS = 2.0  # a shut-down Horovod fails a collective in milliseconds


def collectives_are_down(hvd) -> bool:
    """True when a Horovod collective fails at once: Horovod shut down after losing a rank.

    A healthy Horovod would wait for the other ranks to join the probe, so the
    probe runs in a thread and is given up after `_PROBE_SECONDS`.
    """
    failed = threading.Event()

    def probe():
        try:
            hvd.allreduce(tf.constant(0.0), name="tfdist_liveness_probe", op=hvd.Sum)
        except tf.errors.OpError:
            failed.set()

    thread = threading.Thread(target=probe, name="tfdist-horovod-probe", daemon=True)
    thread.start()
    thread.join(_PROBE_SECONDS)
    return failed.is_set()
