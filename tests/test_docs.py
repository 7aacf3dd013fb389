"""Every ```python block of the README and of docs/ runs, as a user would paste it.

Snippets leave two things to the reader, and this is the hook that fills them
in (docs/testing.md says so):
- the model's layers, written `[...]`: a small digits classifier
  (`README_LAYERS`);
- the data: `x`, `y` (256 digits images, flattened) and `xv`, `yv` (the
  next 128), defined before every block. A fragment (a block that starts
  without an import) also gets what it builds on: `config` (configs/default.yaml),
  its `strategy`, a compiled `model`, a batched `dataset`, a `decode` map and
  `steps`.

Each block runs in a fresh interpreter, in a scratch directory that sees the
repository's `configs/`. The parameter-server block runs as the chief of a
local cluster (TF_CONFIG names it); the Horovod blocks as a single rank, the
elastic Horovod one under an elastic horovodrun of one slot.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from helpers import HOROVODRUN, ROOT, doc_blocks, doc_pages, patient, why_it_failed
import zygote

README_LAYERS = (
    '[keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10, activation="softmax")]'
)

DATA = """
from tfdist.data import load_digits
_pixels, _labels = load_digits()
_images = (_pixels.reshape(len(_pixels), -1) / 16.0).astype("float32")
x, y, xv, yv = _images[:256], _labels[:256], _images[256:384], _labels[256:384]
"""

FRAGMENT = f"""
import keras
import tensorflow as tf
import tfdist
config = tfdist.load_config("configs/default.yaml", ["train.epochs=1"])
strategy = tfdist.make_strategy(config)
with strategy.scope():
    model = keras.Sequential({README_LAYERS})
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
decode = lambda image, label: (image * 2.0 - 1.0, label)
steps = 4
"""


def _run(block: str, tmp_path, env=None) -> subprocess.CompletedProcess:
    (tmp_path / "configs").symlink_to(os.path.join(ROOT, "configs"))
    prelude = DATA + ("" if block.lstrip().startswith("import") else FRAGMENT)
    script = tmp_path / "block.py"
    script.write_text(prelude + block.replace("[...]", README_LAYERS))
    command = [sys.executable, str(script)]
    if "hvd.elastic.run" in block:
        discover = tmp_path / "hosts.sh"
        discover.write_text("#!/bin/sh\necho localhost:1\n")
        discover.chmod(0o755)
        command = [HOROVODRUN, "-np", "1", "--min-np", "1", "--max-np", "1", "--network-interface", "lo",
                   "--host-discovery-script", str(discover), *command]
    return zygote.run(
        command, capture_output=True, text=True, timeout=patient(400), cwd=tmp_path,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})},
    )


def _cases():
    seen = set()
    for page, index, block in doc_blocks("python"):
        if block in seen:  # the README's quick start is also on its docs page: run it once
            continue
        seen.add(block)
        horovod = any(word in block for word in ("HorovodStrategy", 'data_parallel="horovod"', "tfdist.horovod"))
        marks = [pytest.mark.slow] * ("fit(" in block) + [pytest.mark.horovod] * horovod
        yield pytest.param(page, block, id=f"{page}:{index}", marks=marks)


def test_the_docs_have_python_blocks():
    assert len(doc_blocks("python")) >= 8


@pytest.mark.timeout(450)
@pytest.mark.parametrize("page,block", list(_cases()))
def test_docs_block_runs(page, block, tmp_path):
    if "ParameterServerStrategy" in block:
        from tfdist.cluster.servers import LocalCluster

        with LocalCluster(num_workers=2, num_ps=1) as cluster:
            tf_config = {"cluster": cluster.cluster_spec, "task": {"type": "chief", "index": 0}}
            proc = _run(block, tmp_path, env={"TF_CONFIG": json.dumps(tf_config)})
    else:
        proc = _run(block, tmp_path)
    assert proc.returncode == 0, f"a block of {page} failed:\n{block}\n{why_it_failed(proc.stdout + proc.stderr)}"


def test_every_image_the_docs_show_exists():
    """An image a page shows, in Markdown or HTML, relative to the page (mkdocs checks only its links)."""
    shown, missing = 0, []
    for page in doc_pages():
        with open(os.path.join(ROOT, page), encoding="utf-8") as f:
            text = f.read()
        for image in re.findall(r"!\[[^\]]*\]\(([^)\s]+)", text) + re.findall(r"<img [^>]*src=\"([^\"]+)\"", text):
            shown += 1
            if not image.startswith("http") and not os.path.isfile(os.path.join(ROOT, os.path.dirname(page), image)):
                missing.append(f"{page}: {image}")
    assert shown >= 1 and missing == []


def test_every_yaml_block_is_a_valid_config():
    import yaml

    from tfdist.config.loading import from_dict

    blocks = doc_blocks("yaml")
    assert blocks
    for _, _, block in blocks:
        from_dict(yaml.safe_load(block))  # raises ConfigError naming the key
