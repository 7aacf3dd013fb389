"""A strategy kind is its row in tfdist.config.kinds: a row added there alone is validated and launched."""

import dataclasses

import pytest

from tfdist.config import load_config
from tfdist.config.kinds import KINDS, ONE, PARAMETER_SERVERS, RANKS, WORKERS, Kind
from tfdist.errors import ConfigError
from tfdist.launch import k8s, local, slurm

FAKE = Kind("fake_all_reduce", "a test's kind", WORKERS, local_devices=False,
            options=("bytes_per_pack", "shard_optimizer"), all_reduce=("auto", "ring"))


@pytest.fixture
def fake_kind(monkeypatch):
    monkeypatch.setitem(KINDS, FAKE.name, FAKE)


def _refused(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_without_its_row_the_kind_is_unknown():
    _refused([f"strategy.kind={FAKE.name}"], r"^`strategy.kind` must be one of one_device, mirrored, .*, layout\.")


def test_a_new_row_is_validated_by_what_it_says(fake_kind):
    kind = f"strategy.kind={FAKE.name}"
    config = load_config(None, [kind, "strategy.shard_optimizer=1", "strategy.all_reduce=ring",
                                "strategy.bytes_per_pack=4096", "cluster.workers=[127.0.0.1:2222,127.0.0.1:2223]"])
    assert config.strategy.spec is FAKE and config.strategy.launched_as is FAKE
    _refused([kind, "strategy.all_reduce=nccl"], "must be one of auto, ring with strategy.kind=fake_all_reduce")
    _refused([kind, "strategy.tensor_parallel_size=2"],
             "only applies to strategy.kind=pipeline or tensor_parallel; strategy.kind is fake_all_reduce")
    _refused([kind, "strategy.gradient_compression=fp16"], "strategy.kind=multi_worker_mirrored or parameter_server")
    _refused([kind, "pipeline.num_stages=3"], "^`pipeline` only applies with strategy.kind=pipeline")
    _refused([kind, "strategy.devices=[/cpu:0]"], "cannot be set with strategy.kind=fake_all_reduce")
    _refused([kind, "cluster.ps=[127.0.0.1:2224]"], r"^`cluster.ps` only applies to strategy.kind=parameter_server\.")
    _refused([kind, "checkpoint.every_seconds=60"], "fake_all_reduce saves at the same step in every process")
    # The other kinds' refusals name it where it takes an option.
    _refused(["strategy.bytes_per_pack=4096"], "strategy.kind=multi_worker_mirrored or fake_all_reduce")
    _refused(["cluster.workers=[127.0.0.1:2222]"], r"\(multi_worker_mirrored, parameter_server, fake_all_reduce\)")


def _launched(kind: str, *, named: str, workers: int) -> dict:
    """What `tfdist launch`, `tfdist slurm` and `tfdist k8s` make of a job of `kind`, which they call `named`."""
    config = load_config(None, [f"strategy.kind={kind}"])
    tasks = local.plan(config, ["--config", "job.yaml"], workers=workers)
    made = {"launch": [(t.role, t.index, t.reports, t.finishes, t.command[-3:]) for t in tasks]}
    for name, make in (("slurm", lambda: slurm.sbatch_script(config, ["--config", "job.yaml"], tasks=4)),
                       ("k8s", lambda: k8s.manifests(config, k8s.Job(image="tfdist:test", workers=workers)))):
        try:
            made[name] = str(make()).replace(kind, named)
        except ConfigError as error:
            made[name] = f"refused: {error.key}"
    return made


@pytest.mark.parametrize("processes, like", [(WORKERS, "multi_worker_mirrored"), (RANKS, "horovod"),
                                             (PARAMETER_SERVERS, "parameter_server"), (ONE, "mirrored")])
def test_a_new_row_is_launched_as_its_processes_say(monkeypatch, processes, like):
    # A row with another kind's processes and settings gets that kind's tasks, script and manifests.
    fake = dataclasses.replace(KINDS[like], name=f"fake_{like}", processes=processes)
    monkeypatch.setitem(KINDS, fake.name, fake)
    workers = 1 if processes is ONE else 2
    made = _launched(fake.name, named=like, workers=workers)
    assert made == _launched(like, named=like, workers=workers)
    assert [task[0] for task in made["launch"]] == {
        WORKERS: ["worker", "worker"], RANKS: ["horovodrun"], ONE: ["worker"],
        PARAMETER_SERVERS: ["chief", "worker", "worker", "ps"]}[processes]
    if processes is ONE:
        assert made["slurm"] == made["k8s"] == "refused: strategy.kind"
