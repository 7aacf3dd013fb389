"""Precision config -> Keras dtype policy and loss scaling.

Keras 3 wraps the optimizer in a dynamic `LossScaleOptimizer` at compile time
under mixed_float16. tfdist does the wrapping itself (`wrap_optimizer`) so that
the configured initial scale, or the explicit opt-out, is honoured, and then
compiles with `auto_scale_loss=False` so Keras does not wrap twice.

Example:

    >>> from tfdist.config import PrecisionConfig
    >>> apply_policy(PrecisionConfig(policy="mixed_bfloat16"))
    >>> keras.mixed_precision.dtype_policy().name
    'mixed_bfloat16'
"""

from __future__ import annotations

import keras

from tfdist.config.schema import PrecisionConfig, PrecisionPolicy

__all__ = ["apply_policy", "wrap_optimizer"]


def apply_policy(config: PrecisionConfig) -> None:
    """Sets the global Keras dtype policy: layers built afterwards use it."""
    keras.mixed_precision.set_dtype_policy(PrecisionPolicy(config.policy).value)


def wrap_optimizer(optimizer: keras.optimizers.Optimizer, config: PrecisionConfig):
    """Adds loss scaling to `optimizer` where the policy needs it.

    Returns the optimizer unchanged unless the policy is mixed_float16 and
    loss scaling is on; then a `keras.optimizers.LossScaleOptimizer` (dynamic,
    starting at the configured scale).
    """
    if PrecisionPolicy(config.policy) != PrecisionPolicy.MIXED_FLOAT16 or config.loss_scale == "none":
        return optimizer
    kwargs = {} if config.loss_scale == "dynamic" else {"initial_scale": float(config.loss_scale)}
    return keras.optimizers.LossScaleOptimizer(optimizer, **kwargs)
