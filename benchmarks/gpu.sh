#!/usr/bin/env bash
# The GPU check, for the lent GPU machine (one H200, Python 3.12 with torch + CUDA, no network),
# from the repository root, in one call of at most 8 minutes:
#
#   here:    bash benchmarks/gpu_wheels.sh          # once: the wheels the machine lacks -> .whl
#   there:   bash benchmarks/gpu.sh                 # device tool: carry [".whl"], timeout_s 540
#   here:    bash benchmarks/gpu.sh --dry-run       # the same steps on this CPU machine
#
# Steps, each under its own time budget (`timeout`), every figure appended to $OUT as it is
# measured (a step that is killed loses only itself): install the carried wheels and protofl
# (`pip install --no-deps --no-index` into $SITE; the machine's own torch is used), the
# environment (GPU, driver, torch, CUDA) -> env.txt, `pytest -m gpu` -> pytest.txt, the
# trainers' costs calibrated on the GPU (`protofl calibrate`) -> calibrate.txt, then
# speed.py's workloads one by one (mlp, cnn, mnist-protocol, deeplab: protofl vs the plain loop,
# Flower and the floor on the GPU) -> speed.txt and figures.jsonl, and the headline
# `[mnist-protocol] 100 rounds: N s`. gpu.log holds every step's exit status and time.
#
# --dry-run (no GPU, no network): a fresh Python 3.12 venv gets only the wheels (.whl, plus
# .whl-machine standing in for the machine's own packages) with --no-index, installs protofl
# the same way and imports flwr, flwr.simulation, dp_accounting and Ray (and starts Ray). PyPI
# has no CPU torch for Linux, so the steps that need torch (pytest -m gpu, which skips without
# CUDA, and a quick speed workload on the CPU) run under this machine's python with its own
# torch ($DRY_PYTHON, default python3): the install is proven on 3.12, the run on the host's.
set -uo pipefail

DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT=${OUT:-gpu-results}
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/protofl-site}
BUDGET=${BUDGET:-$([ "$DRY" = 1 ] && echo 2400 || echo 480)}  # seconds for the whole script
SCALE=${SCALE:-$([ "$DRY" = 1 ] && echo 5 || echo 1)}  # step budgets x SCALE (a 2-core CPU)
# ONLY="pytest-gpu speed-mlp ...": run just these of the test and benchmark steps (a rerun
# inside what is left of a lease); the installs always run. The steps' budgets (pytest 240 s,
# a workload 120-150 s) do not all fit one 480 s call: on a cold machine (2026-12-04, second
# run) pytest -m gpu with 4 xdist workers had 43 tests done at 100 s, and the MLP's five
# variants needed more than 60 s (Flower's Ray start); pick two or three a call
ONLY=${ONLY:-}
want() { [ -z "$ONLY" ] || [[ " $ONLY " == *" $1 "* ]]; }
mkdir -p "$OUT"
LOG="$OUT/gpu.log"
FIG="$OUT/figures.jsonl"
START=$(date +%s)
export PYTHONUNBUFFERED=1 PROTOFL_CACHE="${PROTOFL_CACHE:-/tmp/protofl-cache}"
# Ray's raylet gives its Python agents ~30 s to start: too short for a first start on a busy
# machine (seen here: the agent took 50 s at a load average of 22)
export RAY_agent_register_timeout_ms=${RAY_agent_register_timeout_ms:-300000}
export RAY_raylet_start_wait_time_s=${RAY_raylet_start_wait_time_s:-300}
log() { echo "[gpu.sh $(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }

step() {  # step NAME SECONDS FILE CMD...: CMD under `timeout`, output appended to $OUT/FILE
  local name=$1 secs=$2 file=$3 left t0 rc
  shift 3
  secs=$((secs * SCALE))
  left=$((BUDGET - ($(date +%s) - START) - 5))
  [ "$secs" -gt "$left" ] && secs=$left
  if [ "$secs" -lt 10 ]; then
    log "$name: SKIPPED (the ${BUDGET} s budget is spent)"
    return 1
  fi
  log "$name: start (at most $secs s)"
  t0=$(date +%s)
  timeout -k 5 "$secs" "$@" 2>&1 | tee -a "$OUT/$file"
  rc=${PIPESTATUS[0]}
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && log "$name: KILLED at its $secs s budget"
  log "$name: exit $rc after $(($(date +%s) - t0)) s"
  echo "{\"step\": \"$name\", \"exit\": $rc, \"seconds\": $(($(date +%s) - t0))}" >> "$FIG"
  return "$rc"
}

# ---- pythons: PYI installs and imports the wheels; PY runs protofl (torch) ----
if [ "$DRY" = 1 ]; then
  PY312=${PY312:-}
  for c in python3.12 /root/.pyenv/versions/3.12*/bin/python3.12; do  # the first that runs
    [ -z "$PY312" ] && "$c" -c "" 2>/dev/null && PY312=$c
  done
  VENV=$(mktemp -d)/venv
  "$PY312" -m venv "$VENV" || { log "FAILED: no Python 3.12 venv ($PY312)"; exit 1; }
  PYI="$VENV/bin/python"
  PY=${DRY_PYTHON:-python3}
  DEVICE=cpu
  rm -rf "$SITE-machine"
  step machine-packages 120 install.txt "$PYI" -m pip install -q --no-index --no-deps \
    --no-compile --no-cache-dir --target "$SITE-machine" "$WHEELS"-machine/*.whl
  export PYTHONPATH="$SITE:$SITE-machine"
else
  PYI=${PYTHON:-python3}
  PY=$PYI
  DEVICE=cuda
  export PYTHONPATH="$SITE"
fi
log "install with $PYI ($("$PYI" --version 2>&1)); run with $PY; device $DEVICE"

# ---- install: the carried wheels, then protofl itself, all without deps or network ----
rm -rf "$SITE" "$SITE-build"
step wheels 120 install.txt "$PYI" -m pip install -q --no-index --no-deps --no-compile \
  --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
# compiled now, in parallel: Ray's dashboard agent, compiling its modules on first import,
# can miss the raylet's start-up deadline on a busy machine
step compile 90 install.txt "$PYI" -m compileall -q -j 0 "$SITE"
BUILD=""
if ! "$PYI" -c "import setuptools" 2>/dev/null; then  # the fresh venv has none
  "$PYI" -m pip install -q --no-index --no-deps --target "$SITE-build" "$WHEELS"/build/*.whl \
    >> "$OUT/install.txt" 2>&1
  BUILD="$SITE-build:"
fi
PYTHONPATH="$BUILD$PYTHONPATH" step protofl 120 install.txt "$PYI" -m pip install -q \
  --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --target "$SITE" .
if [ "$DRY" = 1 ]; then
  step imports-3.12 90 install.txt "$PYI" -c "
import importlib.util, flwr, flwr.simulation, dp_accounting, ray
print('python 3.12:', 'flwr', flwr.__version__, 'ray', ray.__version__, 'protofl at',
      importlib.util.find_spec('protofl').origin)
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
print('ray task:', ray.get(ray.remote(lambda: 6 * 7).remote()))
ray.shutdown()"
  export PYTHONPATH="$PWD/src"  # the host's python: its own packages, this tree's protofl
fi
step imports 60 install.txt "$PY" -c "
import protofl, torch, flwr, flwr.simulation, dp_accounting
print('protofl', protofl.__file__, 'torch', torch.__version__, 'flwr', flwr.__version__)"
FLOWER=$?

# ---- environment ----
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  else
    echo "nvidia-smi: not on this machine"
  fi
  "$PY" -c "import os, torch
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn',
      torch.backends.cudnn.version(), 'cpus', os.cpu_count())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print('device', p.name, f'{p.total_memory / 2**30:.1f} GiB', 'capability',
          f'{p.major}.{p.minor}', 'multiprocessors', p.multi_processor_count)
else:
    print('device: no CUDA')" 2>&1
} > "$OUT/env.txt"
tee -a "$LOG" < "$OUT/env.txt"

# ---- tests, then the benchmarks, one workload a step ----
XDIST=()
"$PY" -c "import xdist" 2>/dev/null && [ "$DRY" = 0 ] && XDIST=(-n 4)
want pytest-gpu && step pytest-gpu 240 pytest.txt "$PY" -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider \
  "${XDIST[@]}"

# the trainers' step costs measured on this GPU (what trainer: auto reads; engine/calibrate.py):
# the default config's MLP and the digits CNN, compiled steps included -> calibrate.txt
if want calibrate; then
  step calibrate-mlp 90 calibrate.txt "$PY" -m protofl calibrate --device "$DEVICE" \
    --set data.num_clients=30
  step calibrate-cnn 90 calibrate.txt "$PY" -m protofl calibrate --device "$DEVICE" \
    --dataset digits --algorithm fedavg
  cat "$PROTOFL_CACHE"/calibration/*.json >> "$OUT/calibrate.txt" 2>/dev/null
fi

SPEED=("$PY" benchmarks/speed.py --quick --no-memory --device "$DEVICE" --jsonl "$FIG")
VARIANTS=${VARIANTS:-auto,compiled,loop,floor}  # compiled: windows of steps as CUDA graphs
[ "$FLOWER" = 0 ] && VARIANTS=$VARIANTS,flower || log "no Flower here: 'vs flower' skipped"
if [ "$DRY" = 1 ]; then
  step speed-mlp 240 speed.txt "${SPEED[@]}" --workloads mlp --variants auto,loop \
    --warmup 1 --rounds 2
else
  for w in mlp:120 cnn:150 mnist-protocol:150 deeplab:120; do
    want "speed-${w%%:*}" && step "speed-${w%%:*}" "${w#*:}" speed.txt "${SPEED[@]}" --workloads "${w%%:*}" \
      --variants "$VARIANTS" --flower-gpus 0.1
  done
  want headline && step headline 150 speed.txt "${SPEED[@]}" --workloads "" --headline
fi

log "figures:"
grep -hE '^\[|peak GPU' "$OUT/speed.txt" 2>/dev/null | tee -a "$LOG"
log "done in $(($(date +%s) - START)) s; results in $OUT"
