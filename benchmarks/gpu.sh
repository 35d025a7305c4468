#!/usr/bin/env bash
# On a CUDA machine, from the repository root:  bash benchmarks/gpu.sh
#
# Runs the `gpu` tests (every algorithm, both trainers, CPU vs CUDA) and `speed.py --quick`
# on the GPU (protofl, the plain loop and the floor on CUDA; Flower's ClientApp actors with
# `--flower-gpus` of the GPU each), and writes everything under $OUT (default ./gpu-results):
# gpu.log, env.txt (date, GPU, driver, torch), pytest.txt, speed.txt, speed.json.
# A few minutes on a recent GPU. Defensive: it uses the python that has a CUDA torch
# ($PYTHON, python3 or python), installs missing wheels with pip (from $WHEELS, a folder of
# wheels, when the machine has no network), and skips Flower if flwr cannot be installed.
set -uo pipefail

OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
LOG="$OUT/gpu.log"
log() { echo "[gpu.sh $(date +%H:%M:%S)] $*" | tee -a "$LOG"; }
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export PROTOFL_CACHE="${PROTOFL_CACHE:-$OUT/cache}"

pip_install() {  # pip_install PKG...: quietly, from $WHEELS if set; never fails the script
  local extra=()
  [ -n "${WHEELS:-}" ] && extra=(--no-index --find-links "$WHEELS")
  timeout 300 "$PY" -m pip install -q ${extra[@]+"${extra[@]}"} "$@" >>"$LOG" 2>&1
}

PY=""
for candidate in "${PYTHON:-}" python3 python; do
  [ -n "$candidate" ] || continue
  if command -v "$candidate" >/dev/null 2>&1 && \
     "$candidate" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
       2>/dev/null; then
    PY=$(command -v "$candidate"); break
  fi
done
if [ -z "$PY" ]; then
  PY=$(command -v "${PYTHON:-python3}" || command -v python)
  log "no python with a CUDA torch; trying: pip install torch (with $PY)"
  pip_install torch
  if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    log "FAILED: torch with CUDA is not available (see $LOG); nothing was run"
    exit 1
  fi
fi
log "python $PY"

for mod_pkg in numpy:numpy sklearn:scikit-learn scipy:scipy yaml:pyyaml tqdm:tqdm \
               PIL:pillow safetensors:safetensors matplotlib:matplotlib pytest:pytest; do
  mod=${mod_pkg%%:*}; pkg=${mod_pkg#*:}
  "$PY" -c "import $mod" 2>/dev/null || { log "installing $pkg"; pip_install "$pkg"; }
done
FLOWER=1
if ! "$PY" -c "import flwr.simulation, ray" 2>/dev/null; then
  log "installing flwr[simulation]"
  pip_install "flwr[simulation]>=1.20" || true
  "$PY" -c "import flwr.simulation, ray" 2>/dev/null || { FLOWER=0; log "no Flower: skipped"; }
fi

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'device', torch.cuda.get_device_name(0))"
  "$PY" -c "import os; print('cpus', os.cpu_count())"
  [ "$FLOWER" = 1 ] && "$PY" -c "import flwr; print('flwr', flwr.__version__)"
} > "$OUT/env.txt" 2>&1
tee -a "$LOG" < "$OUT/env.txt"

log "gpu tests"
timeout 240 "$PY" -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider \
  > "$OUT/pytest.txt" 2>&1
log "gpu tests: exit $? ($(tail -n 1 "$OUT/pytest.txt"))"

VARIANTS=auto,vectorized,sequential,loop,floor
[ "$FLOWER" = 1 ] && VARIANTS=$VARIANTS,flower
log "speed.py --quick on cuda ($VARIANTS)"
timeout 330 "$PY" benchmarks/speed.py --quick --workloads mlp,cnn --device cuda \
  --flower-gpus 0.1 --variants "$VARIANTS" --json "$OUT/speed.json" > "$OUT/speed.txt" 2>&1
log "speed.py: exit $?"
grep -E '^\[|^ *[a-z]+: ' "$OUT/speed.txt" | tee -a "$LOG"
