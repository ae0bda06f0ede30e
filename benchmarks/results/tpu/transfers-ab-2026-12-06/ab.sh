#!/usr/bin/env bash
# A/B on the TPU: the engine before (old_src: c02f312) and after the per-step transfer cut, in-process
# (engine_trace.py) and from the wire (serve --uds + bench --uds, greedy 41/521 tokens at 1 and 8 streams).
set -u
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
mkdir -p /tmp/site
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-tpu/*.whl >/dev/null 2>/tmp/pip.err || { echo "wheels FAILED"; tail -3 /tmp/pip.err; }
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: --no-compile --no-cache-dir --index-url file:///opt/pypi/simple --target /tmp/torch torch==2.13.0 --find-links /opt/wheels >/dev/null 2>/tmp/pip.err || { echo "torch FAILED"; tail -3 /tmp/pip.err; }
rm -rf /tmp/torch/numpy* /tmp/torch/jax* 2>/dev/null
BASE=/tmp/site:${PYTHONPATH:-}:/tmp/torch:$PWD/benchmarks
export PYTHONUNBUFFERED=1
PYTHONPATH=$BASE:$PWD/src python3 -c "from pathlib import Path; from decode import build_checkpoint; build_checkpoint(Path('/tmp/e2b6'))" 2>/dev/null || exit 1
gunzip -c .whl-tpu/tokenizer.json.gz > /tmp/e2b6/tokenizer.json && cp .whl-tpu/tokenizer_config.json /tmp/e2b6/
stamp "checkpoint written"
SOCK=/tmp/gemmax.sock
for round in 1 2; do
for variant in old new; do
  SRC=$PWD/src; [ $variant = old ] && SRC=$PWD/.whl-tpu/old_src
  export PYTHONPATH=$BASE:$SRC
  if [ $round = 1 ]; then
    python3 .whl-tpu/engine_trace.py 4 2>&1 | grep -E "^(1|8) " | sed "s/^/$variant engine c=/"
    stamp "$variant engine done"
  else
    rm -f $SOCK
    python3 -m gemmax.cli serve --model /tmp/e2b6 --uds $SOCK --served-model-name e2b6 > $OUT/serve-$variant.log 2>&1 &
    SERVER=$!
    until curl -sf --unix-socket $SOCK http://localhost/health > /dev/null; do
      kill -0 $SERVER 2>/dev/null || { stamp "serve exited"; tail -20 $OUT/serve-$variant.log; exit 1; }
      sleep 1
    done
    stamp "$variant serve ready"
    python3 -m gemmax.cli bench --base-url http://localhost --uds $SOCK --repeats 3 --output-len 64 --input-lens 41,521 --concurrency 1,8 --out $OUT/bench-$variant.json 2>&1 | grep -E "│" | sed "s/^/$variant /"
    kill -TERM $SERVER; wait $SERVER
    stamp "$variant bench done"
  fi
done
done
