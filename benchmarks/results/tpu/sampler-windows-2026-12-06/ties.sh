#!/usr/bin/env bash
# The sampler alone on the TPU: flat float32 rows against flat rows rounded through bfloat16 (ties).
set -u
mkdir -p /tmp/site
[ -d /tmp/site/pydantic ] || PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-tpu/*.whl >/dev/null 2>/tmp/pip.err || { echo "wheels FAILED"; tail -3 /tmp/pip.err; }
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}:$PWD/src PYTHONUNBUFFERED=1
AGAINST=${AGAINST:-src}
python3 benchmarks/sampling.py --flat --against $AGAINST 2>&1 | grep -v -i Warn | tee $OUT/flat-f32.txt
python3 benchmarks/sampling.py --flat --bf16 --against $AGAINST 2>&1 | grep -v -i Warn | tee $OUT/flat-bf16.txt
