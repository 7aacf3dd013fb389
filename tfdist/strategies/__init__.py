"""Distribution strategies built from config."""

from tfdist.strategies.data_parallel import MirroredStrategy
from tfdist.strategies.factory import make_strategy
from tfdist.strategies.multi_worker import MultiWorkerMirroredStrategy
from tfdist.strategies.pipeline import PipelineStrategy

__all__ = ["MirroredStrategy", "MultiWorkerMirroredStrategy", "PipelineStrategy", "make_strategy"]
