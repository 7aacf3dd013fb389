"""Deprecated: `tfdist.horovod.tensorflow.keras` under the name earlier versions used.

`import tfdist.horovod_keras as hvd` still works and gives the same module
objects (`tfdist.horovod_keras.callbacks` is
`tfdist.horovod.tensorflow.keras.callbacks`), with a DeprecationWarning; it
will be removed in tfdist 0.3. Write `import tfdist.horovod.tensorflow.keras as hvd`.
"""

import sys
import warnings

from tfdist.horovod.tensorflow import keras as _module
from tfdist.horovod.tensorflow.keras import callbacks as _callbacks, optimizer as _optimizer

warnings.warn("tfdist.horovod_keras is deprecated and will be removed in tfdist 0.3: import "
              "tfdist.horovod.tensorflow.keras instead (the same module).", DeprecationWarning, stacklevel=2)

sys.modules[__name__ + ".callbacks"] = _callbacks
sys.modules[__name__ + ".optimizer"] = _optimizer
sys.modules[__name__] = _module
