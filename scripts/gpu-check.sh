#!/usr/bin/env bash
# The trainer on one CUDA GPU (issue #19): a ~0.5B Qwen3-shaped model with random
# weights, a few GRPO steps in bf16 with packing and chunked log-probs, a DCP checkpoint
# saved and loaded, one step's loss on CPU vs GPU, and the elastic domain with a core
# replica and a hybrid on the GPU (state hashes compared) (libra/bench/gpu_check.py).
# About 2 minutes on one H200; the JSON goes to stdout (and to $OUT/gpu-check.json when
# OUT is set).
#
#   scripts/gpu-check.sh wheels     # here (with pip and network): fetch the cp312 wheels
#                                   # the GPU machine lacks into .whl/ (git-ignored)
#   scripts/gpu-check.sh [ARGS...]  # there: install .whl/ if present, run from the tree
#   scripts/gpu-check.sh --profile --steps 3   # there: where a step's time goes
#
# The GPU machine has Python 3.12 and its own torch + CUDA, no network, and cannot take
# this project's torch pin, so nothing is pip-installed from the project: the source
# tree runs through PYTHONPATH, with pydantic and orjson (what the trainer's modules
# import that the machine lacks) carried as wheels. ARGS go to `libra bench gpu-check`.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "wheels" ]; then
    py=${PYTHON:-.venv/bin/python}
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
    mkdir -p .whl
    for pkg in pydantic pydantic_core annotated_types typing_inspection orjson; do
        ver=$("$py" -c "import importlib.metadata as m; print(m.version('$pkg'.replace('_', '-')))")
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 -d .whl "${pkg//_/-}==$ver"
    done
    ls -l .whl
    exit 0
fi

# The package as setup.py lays it out (libra.envs, libra.tools and libra.sandboxes live
# in top-level folders): a tree of links, so that the source runs without an install.
tree=$(mktemp -d /tmp/libra-tree.XXXXXX)
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/libra"
for f in "$PWD"/libra/*; do ln -s "$f" "$tree/libra/"; done
for sub in envs tools sandboxes; do ln -s "$PWD/$sub" "$tree/libra/$sub"; done
export PYTHONPATH=$tree
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/libra-site .whl/*.whl
    export PYTHONPATH=/tmp/libra-site:$tree
fi
export PYTHONUNBUFFERED=1
cd "$tree"  # `python -m` puts the working directory first on the path: not the checkout
rc=0
out=$(python3 -m libra bench gpu-check --json "$@") || rc=$?
echo "$out"
if [ -n "${OUT:-}" ]; then echo "$out" > "$OUT/gpu-check.json"; fi
exit "$rc"
