#!/usr/bin/env bash
# Many users at once on the TPU (no network, no TCP): install the carried wheels and torch (to write the
# checkpoint), build the random E2B-shaped 6-layer checkpoint (benchmarks/decode.py, as rigs_run's e2b6),
# `gemmax serve --uds`, then `gemmax bench --uds` at 1 and 8 streams, greedy, and each sampled setting
# right after a greedy run of its own. Run from the repository root; results under $OUT.
set -u
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
mkdir -p /tmp/site
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-tpu/*.whl >/dev/null 2>/tmp/pip.err || { echo "wheels FAILED"; tail -3 /tmp/pip.err; }
stamp "wheels installed"
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: --no-compile --no-cache-dir --index-url file:///opt/pypi/simple --target /tmp/torch torch==2.13.0 --find-links /opt/wheels >/dev/null 2>/tmp/pip.err || { echo "torch FAILED"; tail -3 /tmp/pip.err; }
rm -rf /tmp/torch/numpy* /tmp/torch/jax* 2>/dev/null
stamp "torch installed"
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}:/tmp/torch:$PWD/src:$PWD/benchmarks
export PYTHONUNBUFFERED=1
CK=/tmp/e2b6
python3 -c "from pathlib import Path; from decode import build_checkpoint; build_checkpoint(Path('$CK'))" || exit 1
gunzip -c .whl-tpu/tokenizer.json.gz > $CK/tokenizer.json && cp .whl-tpu/tokenizer_config.json $CK/
stamp "checkpoint written"
SOCK=/tmp/gemmax.sock
python3 -m gemmax.cli serve --model $CK --uds $SOCK --served-model-name e2b6 > $OUT/serve.log 2>&1 &
SERVER=$!
until curl -sf --unix-socket $SOCK http://localhost/health > /dev/null; do
  kill -0 $SERVER 2>/dev/null || { stamp "serve exited"; tail -30 $OUT/serve.log; exit 1; }
  [ $(( $(date +%s) - t0 )) -lt 400 ] || { stamp "not ready"; tail -30 $OUT/serve.log; exit 1; }
  sleep 1
done
stamp "serve ready"
curl -s --unix-socket $SOCK http://localhost/health > $OUT/health.json
bench() { python3 -m gemmax.cli bench --base-url http://localhost --uds $SOCK --repeats 3 --output-len 64 "$@" 2>&1 | grep -v "^\s*$"; }
bench --input-lens 41,521 --concurrency 1,8 --out $OUT/greedy.json > $OUT/bench.log
stamp "greedy sweep done"
for s in temperature=1.0 temperature=0.7,top_p=0.9 temperature=1.0,top_k=40 temperature=1.0,min_p=0.05; do
  name=$(echo $s | tr ',=' '__')
  bench --input-lens 41 --concurrency 1,8 --out /tmp/pair-greedy-$name.json >> $OUT/bench.log
  bench --input-lens 41 --concurrency 1,8 --sampling $s --out /tmp/pair-$name.json >> $OUT/bench.log
  stamp "sampled $s done"
done
python3 - <<'EOF' > $OUT/sampled.json
import glob, json, os
pairs = {}
for path in sorted(glob.glob("/tmp/pair-*.json")):
    name = os.path.basename(path)[len("pair-"):-len(".json")]
    run = json.load(open(path))
    pairs[name] = [{k: c.get(k) for k in ("concurrency", "decode_tok_s", "output_throughput", "ttft", "flags")}
                   for c in run["cells"]]
print(json.dumps(pairs))
EOF
curl -s --unix-socket $SOCK http://localhost/metrics > $OUT/metrics.txt
kill -TERM $SERVER; wait $SERVER
stamp "done (serve exit $?)"
