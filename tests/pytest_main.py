"""Runs a target's pytest files in one process under `bazel test` (see tests/pytest.bzl); with `shard_count`,
Bazel's shards deal its tests out between them."""

import os
import sys

import pytest


class _Shard:
    """Keeps this shard's tests (Bazel's TEST_SHARD_INDEX of TEST_TOTAL_SHARDS), dealt out back and forth:
    shards 0, 1, 2, 2, 1, 0, 0, 1, ... A parametrized test's cases come with their last parameter varying
    fastest (2 devices, then 4); dealt in turn, every case on 4 devices went to one shard."""

    def __init__(self, index: int, total: int):
        self.index, self.total = index, total

    def _shard_of(self, position: int) -> int:
        round_, place = divmod(position, self.total)
        return place if round_ % 2 == 0 else self.total - 1 - place

    def pytest_collection_modifyitems(self, config, items):
        mine = [self._shard_of(i) == self.index for i in range(len(items))]
        config.hook.pytest_deselected(items=[item for item, kept in zip(items, mine) if not kept])
        items[:] = [item for item, kept in zip(items, mine) if kept]


if __name__ == "__main__":
    plugins = []
    if "TEST_TOTAL_SHARDS" in os.environ:
        open(os.environ["TEST_SHARD_STATUS_FILE"], "w").close()  # tells Bazel this runner shards
        plugins.append(_Shard(int(os.environ["TEST_SHARD_INDEX"]), int(os.environ["TEST_TOTAL_SHARDS"])))
    sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]], plugins=plugins))
