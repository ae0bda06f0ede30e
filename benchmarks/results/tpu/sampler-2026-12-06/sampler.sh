#!/usr/bin/env bash
# The sampler alone on the TPU, before/after side by side (benchmarks/sampling.py --against the
# previous sampling.py), flat and language-model-like logits. Results under $OUT.
set -u
mkdir -p /tmp/site
[ -d /tmp/site/pydantic ] || PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-tpu/*.whl >/dev/null 2>/tmp/pip.err || { echo "wheels FAILED"; tail -3 /tmp/pip.err; }
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}:$PWD/src PYTHONUNBUFFERED=1
python3 benchmarks/sampling.py --flat --against .whl-tpu/old/src 2>&1 | grep -v -i Warn | tee $OUT/sampling-flat.txt
python3 benchmarks/sampling.py --against .whl-tpu/old/src 2>&1 | grep -v -i Warn | tee $OUT/sampling-lm.txt
