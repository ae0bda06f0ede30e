#!/usr/bin/env bash
set -u
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
mkdir -p /tmp/site
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-tpu/*.whl >/dev/null 2>/tmp/pip.err || { echo "wheels FAILED"; tail -3 /tmp/pip.err; }
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: --no-compile --no-cache-dir --index-url file:///opt/pypi/simple --target /tmp/torch torch==2.13.0 --find-links /opt/wheels >/dev/null 2>/tmp/pip.err || { echo "torch FAILED"; tail -3 /tmp/pip.err; }
rm -rf /tmp/torch/numpy* /tmp/torch/jax* 2>/dev/null
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}:/tmp/torch:$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1
python3 -c "from pathlib import Path; from decode import build_checkpoint; build_checkpoint(Path('/tmp/e2b6'))" 2>/dev/null || exit 1
gunzip -c .whl-tpu/tokenizer.json.gz > /tmp/e2b6/tokenizer.json && cp .whl-tpu/tokenizer_config.json /tmp/e2b6/
stamp "checkpoint written"
for spd in "$@"; do python3 .whl-tpu/engine_trace.py $spd 2>&1 | grep -v -i "warn"; stamp "spd $spd done"; done
