#!/bin/bash
# The test suite on another torch release (fivefold runs on torch 2.11 and newer):
#   bash scripts/test_on_torch.sh 2.11.0                      # the whole suite, ~12 min on 2 cores
#   bash scripts/test_on_torch.sh 2.11.0 tests/test_torchrun_options.py   # or what pytest is given
# A venv of its own under runs/torch-VERSION takes PyPI's build of that release (its CUDA libraries
# come along, ~3 GB; it runs on the CPU) and this checkout, installed editable.
set -euo pipefail
version=${1:?usage: bash scripts/test_on_torch.sh VERSION [pytest arguments]}
shift
venv=runs/torch-$version
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null \
  || "$venv/bin/python" -m pip install -q "torch==$version"
"$venv/bin/python" -m pip install -q -e ".[test]"
"$venv/bin/python" -c "import torch; print('torch', torch.__version__)"
"$venv/bin/python" -m pytest -p no:cacheprovider "$@"
