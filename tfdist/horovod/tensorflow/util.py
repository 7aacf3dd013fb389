"""Horovod's `horovod.tensorflow.util`, its own (its tests import `_executing_eagerly` from it)."""

from horovod.tensorflow.util import *  # noqa: F401,F403
from horovod.tensorflow.util import _cache, _executing_eagerly, _make_subgraph  # noqa: F401
