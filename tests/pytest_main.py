"""Runs a target's pytest files in one process under `bazel test` (see tests/pytest.bzl); with `shard_count`,
each of Bazel's shards runs every Nth test of them."""

import os
import sys

import pytest


class _Shard:
    """Keeps tests index, index + total, ... of the collected ones (Bazel's TEST_SHARD_INDEX of TEST_TOTAL_SHARDS):
    the cases of one parametrized test spread over the shards."""

    def __init__(self, index: int, total: int):
        self.index, self.total = index, total

    def pytest_collection_modifyitems(self, config, items):
        mine = [i % self.total == self.index for i in range(len(items))]
        config.hook.pytest_deselected(items=[item for item, kept in zip(items, mine) if not kept])
        items[:] = [item for item, kept in zip(items, mine) if kept]


if __name__ == "__main__":
    plugins = []
    if "TEST_TOTAL_SHARDS" in os.environ:
        open(os.environ["TEST_SHARD_STATUS_FILE"], "w").close()  # tells Bazel this runner shards
        plugins.append(_Shard(int(os.environ["TEST_SHARD_INDEX"]), int(os.environ["TEST_TOTAL_SHARDS"])))
    sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]], plugins=plugins))
