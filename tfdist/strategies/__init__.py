"""Distribution strategies built from config."""

from tfdist.strategies.data_parallel import MirroredStrategy
from tfdist.strategies.factory import make_strategy
from tfdist.strategies.horovod import HorovodStrategy
from tfdist.strategies.multi_worker import MultiWorkerMirroredStrategy
from tfdist.strategies.parameter_server import ParameterServerStrategy
from tfdist.strategies.pipeline import PipelineStrategy
from tfdist.strategies.tensor_parallel import TensorParallelStrategy

__all__ = [
    "HorovodStrategy",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "ParameterServerStrategy",
    "PipelineStrategy",
    "TensorParallelStrategy",
    "make_strategy",
]
