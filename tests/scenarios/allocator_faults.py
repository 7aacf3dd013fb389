"""Prints the page faults a training step of the default job takes, with `runtime.trim_freed_memory` as argv[1]
says (the allocator is set once a process, so each setting needs a process of its own)."""

import json
import os
import resource
import sys

# TensorFlow's own CPU kernels, on every machine: with oneDNN's (its default on CPUs with AVX512_VNNI or AMX)
# the trimming costs far fewer faults (145 a step kept, 557 trimmed, on an Intel Xeon with AMX; 494 and
# 26,330 there with oneDNN off), so the same check would pass or fail by the CPU.
os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"

from tfdist import load_config, training  # noqa: E402

job = training.prepare(load_config(None, ["train.global_batch_size=256", f"runtime.trim_freed_memory={sys.argv[1]}"]))
job.model.fit(job.train_data, epochs=1, steps_per_epoch=3, verbose=0)  # traced, warmed up
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
job.model.fit(job.train_data, epochs=1, steps_per_epoch=10, verbose=0)
print(json.dumps({"faults_per_step": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10}))
