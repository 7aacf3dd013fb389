"""Runs one function of tests/references.py in a process that never imports tfdist, and pickles its result.

    python tests/scenarios/keras_alone.py FUNCTION ARGUMENTS.pickle RESULT.pickle

`tests/oracle.py` starts it from the test zygote's tfdist-free sibling. The process has the suite's 4 logical CPUs,
as the test's process has, and fails, rather than answers, if anything it ran imported tfdist.
"""

import os
import pickle
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                           [tf.config.LogicalDeviceConfiguration()] * 4)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import references  # noqa: E402


def main(function: str, arguments: str, result: str) -> None:
    with open(arguments, "rb") as file:
        args, kwargs = pickle.load(file)
    answer = getattr(references, function)(*args, **kwargs)
    tfdist_modules = sorted(name for name in sys.modules if name == "tfdist" or name.startswith("tfdist."))
    if tfdist_modules:
        sys.exit(f"the reference imported tfdist ({', '.join(tfdist_modules[:3])}): it is no reference")
    with open(result, "wb") as file:
        pickle.dump(answer, file)


if __name__ == "__main__":
    main(*sys.argv[1:])
