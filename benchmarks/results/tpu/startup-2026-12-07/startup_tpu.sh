#!/usr/bin/env bash
# Launch to ready of `gemmax serve` on the TPU v5e (no network, no TCP): unpack the carried
# site-packages (.whl-tpu/site.tar.xz: gemmax's pure dependencies and transformers, installed from
# wheels for CPython 3.11 manylinux x86_64), torch from the machine's own index (to write the
# checkpoint), the random E2B-shaped 6-layer checkpoint (benchmarks/decode.py's build_checkpoint, the
# built-in model's tokenizer files beside it, as users-2026-12-06/users.sh), then
# benchmarks/startup.py over a Unix socket: four starts on one fresh GEMMAX_COMPILE_CACHE (cold, warm,
# JAX's cache only, the start after it), each followed by 3 requests of 41 and 3 of 521 prompt tokens.
# The code that runs is the committed snapshot in .tpu-snap (git archive HEAD src benchmarks, plus this
# change's benchmarks/startup.py), never the live src/. Run from the repository root; results under $OUT.
set -u
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
echo "code: $(cat .tpu-snap/COMMIT) (+ uncommitted benchmarks/startup.py); $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
mkdir -p /tmp/site
python3 -c "import tarfile; tarfile.open('.whl-tpu/site.tar.xz').extractall('/tmp/site')" || { echo "site FAILED"; exit 1; }
stamp "site-packages unpacked"
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: --no-compile --no-cache-dir --index-url file:///opt/pypi/simple --target /tmp/torch torch==2.13.0 --find-links /opt/wheels >/dev/null 2>/tmp/pip.err || { echo "torch FAILED"; tail -3 /tmp/pip.err; exit 1; }
rm -rf /tmp/torch/numpy* /tmp/torch/jax* 2>/dev/null
stamp "torch installed"
SNAP=$PWD/.tpu-snap
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}:/tmp/torch:$SNAP/src:$SNAP/benchmarks
export PYTHONUNBUFFERED=1
python3 -c "import jax, platform; print('jax', jax.__version__, 'python', platform.python_version(), 'glibc', platform.libc_ver()[1])"
CK=/tmp/e2b6
python3 -c "from pathlib import Path; from decode import build_checkpoint; build_checkpoint(Path('$CK'))" 2>&1 | grep -v "Writing model shards" || true
[ -f $CK/model.safetensors ] || { stamp "checkpoint FAILED"; exit 1; }
gunzip -c .whl-tpu/tokenizer.json.gz > $CK/tokenizer.json && cp .whl-tpu/tokenizer_config.json $CK/
du -sh $CK
stamp "checkpoint written"
left=$(( 570 - ($(date +%s) - t0) ))
stamp "startup.py, time guard ${left} s"
timeout $left python3 $SNAP/benchmarks/startup.py --src "$(cut -c1-7 .tpu-snap/COMMIT)=$SNAP/src" \
  --uds /tmp/gemmax.sock --pause 5 --lengths 41,521 --repeats 3 --timeout 400 --out-dir /tmp/su \
  -- --model $CK > $OUT/startup.txt 2> $OUT/startup.err
stamp "startup.py exit $?"
for f in /tmp/su/*.log; do echo "===== $(basename "$f")"; cat "$f"; done > $OUT/serve-logs.txt
stamp "done"
