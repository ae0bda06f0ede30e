#!/usr/bin/env bash
# gemmax's device check (benchmarks/device_check.py --full) on the TPU v5e, one device call per
# section set: `bash .whl-tpu/device_check_tpu.sh SECTIONS BUDGET_S` from the repository root, with
# carry [".tpu-snap", ".whl-tpu"]. Unpacks the carried site-packages (.whl-tpu/site.tar.xz: gemmax's
# pure dependencies and transformers 5.23.0, installed from wheels for CPython 3.11 manylinux x86_64)
# into /tmp/site, installs torch 2.13.0 (CPU, the parity reference) from the machine's own index, and
# runs the check of the committed snapshot in .tpu-snap (git archive HEAD src benchmarks tests), never
# the live src/. Each step is skipped where a warm machine already has it. Results under $OUT.
set -u
SECTIONS=$1
BUDGET=${2:-420}
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
SNAP=$PWD/.tpu-snap
echo "code: $(cat $SNAP/COMMIT); sections $SECTIONS; $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
if [ ! -f /tmp/site/.unpacked ]; then
  mkdir -p /tmp/site
  python3 -c "import tarfile; tarfile.open('.whl-tpu/site.tar.xz').extractall('/tmp/site')" || { echo "site FAILED"; exit 1; }
  touch /tmp/site/.unpacked
  stamp "site-packages unpacked"
else
  stamp "site-packages already there"
fi
if [ ! -d /tmp/torch/torch ]; then
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: --no-compile --no-cache-dir \
    --index-url file:///opt/pypi/simple --target /tmp/torch torch==2.13.0 --find-links /opt/wheels >/dev/null 2>/tmp/pip.err \
    || { echo "torch FAILED"; tail -3 /tmp/pip.err; exit 1; }
  rm -rf /tmp/torch/numpy* /tmp/torch/jax* 2>/dev/null
  stamp "torch installed"
else
  stamp "torch already there"
fi
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}:/tmp/torch:$SNAP/src:$SNAP/benchmarks
export PYTHONUNBUFFERED=1
python3 -c "import jax, platform, gemmax, torch, transformers; print('jax', jax.__version__, 'python', platform.python_version(), 'glibc', platform.libc_ver()[1], 'torch', torch.__version__, 'transformers', transformers.__version__, 'gemmax from', gemmax.__file__)" \
  || { stamp "imports FAILED"; exit 1; }
left=$(( 570 - ($(date +%s) - t0) ))
stamp "device_check.py --full --sections $SECTIONS --budget-s $BUDGET, time guard ${left} s"
timeout $left python3 $SNAP/benchmarks/device_check.py --full --sections "$SECTIONS" --budget-s "$BUDGET" --out "$OUT"
stamp "device_check.py exit $?"
