"""docs/config.md, the config reference, is what tools/config_reference.py writes from the schema."""

import dataclasses
import os
import subprocess
import sys

from helpers import ROOT

from tfdist.config import schema

TOOL = os.path.join(ROOT, "tools", "config_reference.py")


def test_the_committed_reference_is_the_generated_one():
    proc = subprocess.run([sys.executable, TOOL, "--check"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


def test_every_key_of_every_section_is_in_the_reference():
    page = open(os.path.join(ROOT, "docs", "config.md"), encoding="utf-8").read()
    for section in dataclasses.fields(schema.Config):
        for field in dataclasses.fields(section.default):
            assert f"| `{section.name}.{field.name}` |" in page, f"{section.name}.{field.name}"
