#!/usr/bin/env bash
# bash bench/gpu/check.sh OUT_DIR [options]: python -m bench.gpu from the checkout (see its --help).
# PYTHON picks the interpreter (default: python3, the one that has torch and triton).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec "${PYTHON:-python3}" -m bench.gpu "$@"
