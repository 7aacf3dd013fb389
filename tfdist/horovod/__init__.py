"""Horovod's TensorFlow APIs on Keras 3: prefix Horovod's import with `tfdist.`.

    import horovod.tensorflow as hvd                ->  import tfdist.horovod.tensorflow as hvd
    import horovod.tensorflow.keras as hvd          ->  import tfdist.horovod.tensorflow.keras as hvd

Horovod 0.28 treats model and optimizer variables as `tf.Variable`s (it calls
`.ref()` on them, assigns them in its own functions); Keras 3 variables are
not, so its tapes, broadcasts, optimizers and elastic states fail on them.
These modules pass Horovod the `tf.Variable` behind each Keras variable, or
do with Horovod's collective ops what its Keras layer did, and leave
everything that already works to Horovod.
"""
