#!/usr/bin/env bash
# Wheels the H200 image lacks (datasets and its pure-Python deps; numpy<2.4 for the interpreter tests under
# Triton 3.6), fetched here for its Python 3.12 into .whl/, which h200_check.sh installs from; the machine
# itself reaches no package index. Usage: bash scripts/h200_wheels.sh [PYTHON_VERSION]
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
for requirement in "datasets==5.2.0" dill multiprocess "numpy<2.4"; do
  python3 -m pip download -q --no-deps --only-binary :all: --python-version "${1:-3.12}" \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl "$requirement"
done
ls .whl
