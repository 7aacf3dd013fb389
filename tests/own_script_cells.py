"""The cells of docs/own-script.md's two tables: each guide script under a kind, and launched as a job, with what
the cell says once the test named beside it has passed. tests/test_guide_scripts.py runs most of them;
tools/own_script_table.py writes the tables from a run's JUnit results, so a cell shows only what passed.

Plain data, without pytest or TensorFlow, so the tool can read it."""

TWO_DEVICES = ["strategy.logical_devices=2"]
KINDS = {  # the one-process kinds, each on 2 logical devices: column -> the script's --set values
    "mirrored": ["strategy.kind=mirrored", *TWO_DEVICES],
    "mirrored, shard_optimizer 1": ["strategy.kind=mirrored", "strategy.shard_optimizer=1", *TWO_DEVICES],
    "mirrored, shard_optimizer 2": ["strategy.kind=mirrored", "strategy.shard_optimizer=2", *TWO_DEVICES],
    "mirrored, shard_optimizer 3": ["strategy.kind=mirrored", "strategy.shard_optimizer=3", *TWO_DEVICES],
    "pipeline": ["strategy.kind=pipeline", *TWO_DEVICES],  # one replica of 2 stages
    "tensor_parallel": ["strategy.kind=tensor_parallel", *TWO_DEVICES],  # one group of 2: Megatron's split
}
UNDER_A_KIND = "tests/test_guide_scripts.py::test_a_guide_script_under_a_kind_equals_one_device"
# A model split over devices trains with fit: a custom loop's loss scaling would count each example once per device.
REFUSED_CUSTOM_LOOP = "the custom loop refused in one line"
# guide script -> kind -> what the cell says; each is the test UNDER_A_KIND[script-kind].
MATRIX = {
    "guide_keras_distributed.py": {kind: "equal" for kind in KINDS},
    "guide_custom_training_loop.py": {
        **{kind: "equal" for kind in KINDS},
        "mirrored, shard_optimizer 1": "equal, optimizer not split (says so)",
        "mirrored, shard_optimizer 2": "equal, optimizer not split (says so)",
        "mirrored, shard_optimizer 3": "equal, optimizer not split (says so)",
        "pipeline": "equal, not pipelined (says so)",
        "tensor_parallel": REFUSED_CUSTOM_LOOP,
    },
    "guide_multi_worker_keras.py": {kind: "equal" for kind in KINDS},  # without TF_CONFIG: one process
    "guide_parameter_server.py": {  # its custom loop runs `strategy.run` steps off a cluster
        **{kind: "equal" for kind in KINDS},
        "mirrored, shard_optimizer 1": "equal, the custom loop's optimizer not split (says so)",
        "mirrored, shard_optimizer 2": "equal, the custom loop's optimizer not split (says so)",
        "mirrored, shard_optimizer 3": "equal, the custom loop's optimizer not split (says so)",
        "pipeline": "equal, the custom loop not pipelined (says so)",
        "tensor_parallel": REFUSED_CUSTOM_LOOP,
    },
}

# Scripts launched as several processes (`tfdist launch -- python ...`).
MULTI_WORKER = "tfdist launch --workers 2 (multi-worker)"
HOROVOD = "tfdist launch --workers 2 (Horovod)"
PARAMETER_SERVERS = "tfdist launch --workers 1 --ps 1 (parameter servers)"
SLURM = "tfdist slurm --tasks 3 (parameter servers, on a real Slurm)"
PODS = "tfdist k8s --workers 2 (multi-worker pods, run as local processes)"
HOSTS = "tfdist launch --workers 2 --hosts 2 --link 1gbit (multi-worker on two namespace hosts)"
JOBS = {  # job -> the launcher's task flags, the strategy, how many processes run the script
    MULTI_WORKER: (["--workers", "2"], "strategy.kind=multi_worker_mirrored", 2),
    HOROVOD: (["--workers", "2"], "strategy.kind=horovod", 2),
    PARAMETER_SERVERS: (["--workers", "1", "--ps", "1"], "strategy.kind=parameter_server", 1),  # the chief's
    HOSTS: (["--workers", "2", "--hosts", "2", "--link", "1gbit"], "strategy.kind=multi_worker_mirrored", 2),
}
LAUNCHED_EQUAL = "tests/test_guide_scripts.py::test_a_guide_script_launched_as_several_processes_equals_one_device"
_HOROVOD_KERAS = "the checkpoints rank 0 saves load with their `DistributedOptimizer`"
# guide script -> job -> (what the cell says, the test that shows it; None: LAUNCHED_EQUAL[script-job]).
LAUNCHED = {
    "guide_keras_distributed.py": {job: ("equal", None) for job in (MULTI_WORKER, HOROVOD, PARAMETER_SERVERS, HOSTS)},
    "guide_custom_training_loop.py": {
        MULTI_WORKER: ("equal", None),
        HOROVOD: ("equal", None),
        PARAMETER_SERVERS: ("refused in one line: schedule the step with `ClusterCoordinator`",
                            "tests/test_guide_scripts.py::"
                            "test_a_custom_loop_called_on_the_parameter_servers_chief_is_refused_in_one_line"),
    },
    "guide_multi_worker_keras.py": {
        MULTI_WORKER: ("equal", "tests/launch/test_local.py::"
                                "test_a_users_own_script_runs_as_every_task_and_trains_as_on_one_device"),
        HOROVOD: ("equal", None),  # its chief found by `strategy.cluster_resolver`: rank 0 is worker 0
        PARAMETER_SERVERS: ("equal", None),  # one worker runs the steps in order
        SLURM: ("trains; the chief runs it, the others serve, the chief saves the model", "tests/launch/test_slurm.py::"
                "test_a_users_own_script_runs_through_sbatch_on_the_chief_and_tfdist_serves_it"),
        PODS: ("trains; the chief saves the model",
               "tests/launch/test_k8s.py::test_a_users_own_script_runs_in_the_pods"),
    },
    "guide_parameter_server.py": {
        PARAMETER_SERVERS: ("equal (`fit`, and the custom loop of `ClusterCoordinator.schedule` steps)", None),
        MULTI_WORKER: ("equal (`fit`, and the custom loop of `strategy.run` steps)", None),
        HOROVOD: ("equal (`fit`, and the custom loop of `strategy.run` steps)", None),
    },
    # Horovod's examples scale the rate by the ranks and shuffle each rank's shard: their own accuracy bound.
    "horovod_keras_digits.py": {
        HOROVOD: (f"trains digits to 0.95 or more; {_HOROVOD_KERAS}", "tests/strategies/test_horovod.py::"
                  "test_a_horovod_keras_script_runs_with_only_its_import_changed_under_tfdist_launch"),
    },
    "horovod_tensorflow_digits.py": {
        HOROVOD: ("trains digits to 0.95 or more; rank 0 alone logs and saves", "tests/horovod/"
                  "test_horovod_tensorflow.py::test_a_custom_loop_script_trains_digits_with_only_its_import_changed_"
                  "under_tfdist_launch"),
    },
}


def kind_cells() -> list[tuple[str, str, str, str]]:
    """(script, kind, what the cell says, its test's id) of the table of kinds, row by row."""
    return [(script, kind, says, f"{UNDER_A_KIND}[{script}-{kind}]")
            for script, row in MATRIX.items() for kind, says in row.items()]


def launched_cells() -> list[tuple[str, str, str, str]]:
    """(script, job, what the cell says, its test's id) of the table of launched jobs, row by row."""
    return [(script, job, says, test or f"{LAUNCHED_EQUAL}[{script}-{job}]")
            for script, row in LAUNCHED.items() for job, (says, test) in row.items()]
