#!/usr/bin/env bash
# The executable store (programs read back from JAX's cache stored with their entry's bytes) and the lazy tokenizer on the TPU.
set -u
mkdir -p /tmp/site
[ -d /tmp/site/pydantic ] || PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-tpu/*.whl >/dev/null 2>/tmp/pip.err || { echo "wheels FAILED"; tail -3 /tmp/pip.err; }
[ -d /tmp/torch/torch ] || PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: --no-compile --no-cache-dir --index-url file:///opt/pypi/simple --target /tmp/torch torch==2.13.0 --find-links /opt/wheels >/dev/null 2>/tmp/pip.err || { echo "torch FAILED"; tail -3 /tmp/pip.err; }
rm -rf /tmp/torch/numpy* /tmp/torch/jax* 2>/dev/null
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-compile --no-cache-dir --index-url file:///opt/pypi/simple --target /tmp/pt pytest >/dev/null 2>/tmp/pip.err || { echo "pytest FAILED"; tail -3 /tmp/pip.err; }
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}:/tmp/torch:/tmp/pt:$PWD/src PYTHONUNBUFFERED=1
python3 -c "import jax; print(jax.devices())"
python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_executables.py tests/test_loading.py ${TESTS:-} 2>&1 | tail -40
