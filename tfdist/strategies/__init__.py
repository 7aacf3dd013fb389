"""Distribution strategies built from config."""

from tfdist.strategies.factory import make_strategy

__all__ = ["make_strategy"]
