"""The oracle that never saw tfdist: what Keras alone trains, computed in a process that never imported tfdist.

    from oracle import keras_alone
    expected = keras_alone("fit", compiled_model, x, y, batch_size=8, epochs=2)

An "equals one device" test compares tfdist's run, in the test's process, with a function of tests/references.py run
in a child forked from the test zygote's tfdist-free sibling (tests/scenarios/keras_alone.py), so a change tfdist
made to Keras in the test's process cannot reach the reference. The arguments and the result cross as pickles; a
Keras model argument as its `.keras` file (compiled: with its optimizer, loss and metrics).
"""

import os
import pickle
import sys
import tempfile

import zygote
from helpers import ROOT, SCENARIO_DIR, patient, why_it_failed

SCRIPT = os.path.join(SCENARIO_DIR, "keras_alone.py")


def keras_alone(function: str, *args, timeout: float = 300, **kwargs):
    """`references.<function>(*args, **kwargs)` computed in a process that never imported tfdist."""
    with tempfile.TemporaryDirectory(prefix="keras_alone_") as scratch:
        arguments, result = os.path.join(scratch, "arguments.pickle"), os.path.join(scratch, "result.pickle")
        args = [_saved(arg, os.path.join(scratch, f"model_{i}.keras")) for i, arg in enumerate(args)]
        with open(arguments, "wb") as file:
            pickle.dump((args, kwargs), file)
        done = zygote.run([sys.executable, SCRIPT, function, arguments, result], cwd=ROOT, capture_output=True,
                          text=True, timeout=patient(timeout), env={**os.environ, zygote.WITHOUT_TFDIST_VARIABLE: "1"})
        assert done.returncode == 0, f"the reference {function} failed: {why_it_failed(done.stderr)}"
        with open(result, "rb") as file:
            return pickle.load(file)


def _saved(value, path: str):
    import keras

    if not isinstance(value, keras.Model):
        return value
    value.save(path)
    return path
