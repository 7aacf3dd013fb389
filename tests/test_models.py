"""The config-built models: shapes, and the pixel tokens the embedding model reads."""

import keras
import numpy as np
import pytest

from tfdist import models
from tfdist.config import ModelConfig
from tfdist.layers import ShardedEmbedding


def test_pixel_tokens_encode_position_and_intensity_level():
    images = np.array([[[0.0, 1.0], [0.5, 2.0]]], dtype="float32")[..., None]  # 2x2, one clipped
    tokens = keras.ops.convert_to_numpy(models.PixelTokens(levels=9)(images))
    np.testing.assert_array_equal(tokens, [[0 * 9 + 0, 1 * 9 + 8, 2 * 9 + 4, 3 * 9 + 8]])  # exact: integers


@pytest.mark.parametrize("name", ["digits_cnn", "mlp", "pixel_embedding"])
def test_every_model_classifies(name):
    model = models.build(ModelConfig(name=name, width=8), input_shape=(8, 8, 1), num_classes=10)
    assert model.output_shape == (None, 10)
    assert model.predict(np.random.rand(3, 8, 8, 1).astype("float32"), verbose=0).shape == (3, 10)


def test_pixel_embedding_table_has_a_row_per_pixel_and_level():
    model = models.build(ModelConfig(name="pixel_embedding", width=8), input_shape=(8, 8, 1), num_classes=10)
    table = [layer for layer in model.layers if isinstance(layer, ShardedEmbedding)]
    assert [(t.input_dim, t.output_dim) for t in table] == [(64 * models.INTENSITY_LEVELS, 8)]
