"""The handwritten digits: 1,797 images of 8x8 pixels, shipped with tfdist.

The data is the test set of the UCI "Optical Recognition of Handwritten Digits"
(E. Alpaydin, C. Kaynak, 1998; CC BY 4.0), the same copy scikit-learn's
`load_digits` ships. tfdist carries it (45 KB) so that neither the default job
nor the tests import scikit-learn: Keras imports scikit-learn (and SciPy) at its
own import whenever it is installed, about 1.3 CPU-seconds of every process.
"""

import os
from typing import NamedTuple

import numpy as np

_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "digits.npz")


class Digits(NamedTuple):
    """The images, `(1797, 8, 8)` uint8 pixels from 0 to 16, and their labels, `(1797,)` int64 from 0 to 9."""

    images: np.ndarray
    labels: np.ndarray


def load_digits() -> Digits:
    """The digits images and labels, in scikit-learn's order.

    Example:
        >>> images, labels = load_digits()
        >>> x = (images / 16.0).astype("float32")[..., None]  # (1797, 8, 8, 1) in [0, 1]
    """
    with np.load(_FILE) as data:
        return Digits(data["images"], data["labels"].astype(np.int64))
