#!/usr/bin/env bash
# Builds horovod from source against the venv's TensorFlow (once per TensorFlow
# and Python version, cached outside the repo) and installs it into the venv.
# Gloo and MPI controllers: horovodrun --gloo needs nothing else; Adasum needs MPI.
# Usage: tools/install_horovod.sh VENV_BIN [CACHE_DIR]
# Horovod 0.28.1 has no wheel for current TensorFlow, and builds against it only
# with Debian's libhighwayhash-dev and libfarmhash-dev (headers TensorFlow's XLA
# headers include; the Makefile installs them), the forwarding header below,
# and --no-build-isolation so the build sees the venv's TensorFlow.
set -euo pipefail

HOROVOD_VERSION=0.28.1
bin=$1
cache_root=${2:-${XDG_CACHE_HOME:-$HOME/.cache}/tfdist}

versions=$("$bin/python" - <<'PY'
import importlib.metadata as metadata, sys
for dist in ("tensorflow-cpu", "tensorflow"):
    try:
        print(f"tf{metadata.version(dist)}-py{sys.version_info[0]}{sys.version_info[1]}")
        break
    except metadata.PackageNotFoundError:
        pass
else:
    sys.exit("install TensorFlow before building horovod")
PY
)
cache="$cache_root/horovod-$HOROVOD_VERSION-gloo-mpi-$versions"

if ! ls "$cache"/horovod-*.whl >/dev/null 2>&1; then
    echo "building horovod $HOROVOD_VERSION against $versions (about 5 minutes; cached in $cache)"
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    # XLA moved xla_builder.h; Horovod 0.28.1 still includes it by its old path.
    mkdir -p "$work/include/tensorflow/compiler/xla/client"
    echo '#include "xla/hlo/builder/xla_builder.h"' > "$work/include/tensorflow/compiler/xla/client/xla_builder.h"
    # --no-cache-dir: pip's wheel cache ignores the HOROVOD_* options and would
    # hand back an earlier build.
    CPATH="$work/include${CPATH:+:$CPATH}" \
    HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
    HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$(nproc)" \
        "$bin/pip" wheel --quiet --no-cache-dir --no-build-isolation --no-deps --wheel-dir "$work/wheel" "horovod==$HOROVOD_VERSION"
    mkdir -p "$cache"
    mv "$work"/wheel/horovod-*.whl "$cache"/  # only a finished wheel reaches the cache
fi

# --no-deps: the wheel's own requirements would pull a second TensorFlow.
# --force-reinstall: an installed horovod of the same version may be another build.
"$bin/pip" install --quiet --no-deps --force-reinstall "$cache"/horovod-*.whl
"$bin/pip" install --quiet cloudpickle psutil pyyaml packaging cffi
