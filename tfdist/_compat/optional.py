"""Optional packages, each imported on first use with a one-line error that says how to get it."""

from __future__ import annotations

__all__ = ["horovod", "nvml", "pyplot", "xspace"]

def horovod():
    """`horovod.tensorflow`, or an ImportError that says in one line how to get it.

    Horovod 0.28.1 has no wheel for current TensorFlow; it is built from source
    by `tools/install_horovod.sh` (which `make setup` runs).
    """
    try:
        import horovod.tensorflow as hvd
    except ImportError as error:
        raise ImportError(
            f"Horovod is not installed ({error}); build and install it with "
            "`tools/install_horovod.sh .venv/bin` (make setup does this)."
        ) from None
    return hvd

def nvml():
    """`pynvml` from nvidia-ml-py (NVIDIA's NVML bindings), or an ImportError that says how to get it."""
    try:
        import pynvml
    except ImportError as error:
        raise ImportError(f"nvidia-ml-py is not installed ({error}); pip install 'tfdist[monitor]'.") from None
    return pynvml

def pyplot():
    """`matplotlib.pyplot` drawing to files only (the Agg backend), or an ImportError that says how to get it."""
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError(f"matplotlib is not installed ({error}); pip install 'tfdist[plots]'.") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt

def xspace(path: str):
    """A profile written by `tf.profiler` (an `.xplane.pb` file), parsed.

    The profiler has no public reader: TensorBoard's profile plugin reads the
    same protobuf, whose Python module ships with TensorFlow under `tsl`.
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    return space
