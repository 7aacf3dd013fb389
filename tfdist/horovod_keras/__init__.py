"""`tfdist.horovod.tensorflow.keras` under the name earlier versions used (`import tfdist.horovod_keras as hvd`).

The same module objects, not copies: `tfdist.horovod_keras.callbacks` is
`tfdist.horovod.tensorflow.keras.callbacks`.
"""

import sys

from tfdist.horovod.tensorflow import keras as _module
from tfdist.horovod.tensorflow.keras import callbacks as _callbacks, optimizer as _optimizer

sys.modules[__name__ + ".callbacks"] = _callbacks
sys.modules[__name__ + ".optimizer"] = _optimizer
sys.modules[__name__] = _module
