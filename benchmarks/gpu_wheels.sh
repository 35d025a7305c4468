#!/usr/bin/env bash
# Wheels for benchmarks/gpu.sh, made HERE (a machine with PyPI) for the lent GPU machine
# (Python 3.12, x86-64, no network):   bash benchmarks/gpu_wheels.sh [DEST]   (default .whl)
#
# Downloads Flower with its simulation engine (Ray) and dp-accounting, pinned to the versions
# protofl is tested with, as Python 3.12 manylinux wheels with all their dependencies
# (`pip download --only-binary=:all: --python-version 3.12 --platform manylinux...`, the device
# README's recipe), then keeps only those the machine lacks: every package named in
# benchmarks/gpu_machine_packages.txt (torch among them) is dropped, and so is `uv` (the
# binary Flower's CLI packages apps with; a simulation never calls it). Ray's wheel (74 MB) is
# re-packed without ray/jars (the Java workers' jar, 30 MB), the dashboard's web client and the
# Ray libraries Flower never imports, so
# that everything fits the device tool's 64 MiB carry limit (the wheels plus the working tree).
# DEST/build/ gets setuptools, for a python without it (the dry run's fresh venv) to build
# protofl's own wheel. DEST is git-ignored (/.whl/); carry it with the run: carry [".whl"].
# The wheels left out (the machine's own packages, with protofl's base dependencies and
# pytest added to the download) go to DEST-machine/ (git-ignored, never carried): the dry
# run (`gpu.sh --dry-run`) installs them into its fresh Python 3.12 venv to stand in for
# the machine's packages. torch is not among them: PyPI has no CPU build of it for Linux
# (its Linux wheel is the CUDA one, ~900 MB plus ~3 GB of NVIDIA libraries).
set -euo pipefail

DEST=${1:-.whl}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
PY=${PYTHON:-python3}
REQS=("flwr[simulation]==1.42.0" "dp-accounting==0.6.0")
BASE=(numpy scikit-learn scipy matplotlib pyyaml tqdm pillow safetensors pytest)  # the machine's
DROP="uv"  # besides the machine's packages
LIMIT=$((64 << 20))  # the device tool's carry limit: tree + carried paths
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_5_x86_64; do
  PLATFORMS+=(--platform "$p")
done

STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
echo "downloading ${REQS[*]} and their dependencies (cp312, manylinux x86-64)"
"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d "$STAGE/all" "${REQS[@]}" "${BASE[@]}" 2> >(grep -v "is ignored" >&2)
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$STAGE/build" "setuptools>=70" \
  2> >(grep -v "is ignored" >&2)

rm -rf "$DEST" "$DEST-machine"
mkdir -p "$DEST/build" "$DEST-machine"
cp "$STAGE"/build/*.whl "$DEST/build/"
"$PY" - "$STAGE/all" "$DEST" "$DEST-machine" "$HERE/gpu_machine_packages.txt" "$DROP" <<'EOF'
import re, shutil, sys, zipfile
from pathlib import Path

stage, dest, machine = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
listing, drop = sys.argv[4], sys.argv[5]
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
have = {norm(l.strip()) for l in open(listing) if l.strip() and not l.startswith("#")}
have |= {norm(d) for d in drop.split()}
# Java workers; the web UI; Ray's libraries that Flower's simulation never imports (the
# 64 MiB carried with the working tree is otherwise just exceeded)
SLIM = ("ray/jars/", "ray/dashboard/client/build/", "ray/rllib/", "ray/llm/", "ray/serve/",
        "ray/data/", "ray/tune/", "ray/train/")
for whl in sorted(stage.glob("*.whl")):
    name = norm(whl.name.split("-")[0])
    if name in have or name.startswith("nvidia-"):
        print(f"  left out (on the machine, or not needed): {whl.name}")
        shutil.copy(whl, machine / whl.name)
        continue
    out = dest / whl.name
    if name != "ray":
        shutil.copy(whl, out)
        continue
    with zipfile.ZipFile(whl) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename.startswith(SLIM):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(l for l in data.splitlines(keepends=True)
                                if not l.decode().startswith(SLIM))
            dst.writestr(info, data)
    print(f"  re-packed without {', '.join(SLIM)}: {whl.name}")
EOF

tree=$(cd "$ROOT" && git ls-files -co --exclude-standard -z | xargs -0 cat 2>/dev/null | wc -c)
wheels=$(du -cb "$DEST" | tail -n 1 | cut -f1)
echo "carried wheels: $(ls "$DEST"/*.whl | wc -l) in $DEST, $((wheels >> 20)) MiB; working tree" \
     "$((tree >> 20)) MiB; together $(((wheels + tree) >> 20)) of $((LIMIT >> 20)) MiB"
if [ $((wheels + tree)) -ge "$LIMIT" ]; then
  echo "FAILED: over the device tool's 64 MiB carry limit" >&2
  exit 1
fi
