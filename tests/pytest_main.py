"""Runs a target's pytest files in one process under `bazel test` (see tests/pytest.bzl)."""

import sys

import pytest

if __name__ == "__main__":
    sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
