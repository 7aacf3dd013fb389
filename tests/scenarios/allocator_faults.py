"""Prints the page faults a training step of the default job takes, with `runtime.trim_freed_memory` as argv[1]
says (the allocator is set once a process, so each setting needs a process of its own)."""

import json
import resource
import sys

from tfdist import load_config, training

job = training.prepare(load_config(None, ["train.global_batch_size=256", f"runtime.trim_freed_memory={sys.argv[1]}"]))
job.model.fit(job.train_data, epochs=1, steps_per_epoch=3, verbose=0)  # traced, warmed up
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
job.model.fit(job.train_data, epochs=1, steps_per_epoch=10, verbose=0)
print(json.dumps({"faults_per_step": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10}))
