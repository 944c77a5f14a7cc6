#!/usr/bin/env bash
# nbdist's GPU check in one go (issue 17): `nbdist doctor`, the GPU test files, a short
# benchmark. Finishes within NBDIST_GPU_CHECK_S seconds (default 450: two runs fit in this
# workplace's 15 minutes of device time, machine start included).
#
# Where: Linux x86-64 with NVIDIA GPU(s), possibly without network, whose python3 already
# has torch with CUDA, CuPy, NCCL (an nvidia-nccl wheel), pytest, pytest-timeout, cmake,
# ninja and a C++ compiler: this workplace's H200 image (Python 3.12, torch 2.11+cu130,
# cupy-cuda13x, nvidia-nccl-cu13). What it lacks (ipyparallel, IPython, jupyter_client,
# nbclient, mpich + mpi4py, the build pins, ...: tests/gpu/wheels.txt) travels as wheels
# in .whl/, which git ignores. Beforehand, where pip reaches an index:
#
#     bash tests/gpu/fetch_wheels.sh      # → .whl/ (~32 MiB, checked against the 64 MiB limit)
#
# Then through the device tool (see docs/gpu.md):
#
#     run(command="bash tests/gpu/check.sh", carry=[".whl"], timeout_s=540)
#
# Steps: (1) what the machine has (nvidia-smi, torch, CuPy, NCCL); (2) a venv in
# /tmp/nbdist-gpu that sees the image's packages (a .pth line) and gets the carried wheels;
# (3) nbdist built there (pip -e, no build isolation, no index); (4) `nbdist doctor` on 1 rank
# and under `mpiexec -n 2`; (5) pytest on tests/test_gpu_*.py and tests/test_torch_cuda.py;
# (6) benchmarks/gpu_nccl.py on one rank per GPU. A failed step is recorded and the next
# ones still run. Logs go to $OUT (what the device tool brings back) or test-output/gpu/:
# check.log (everything), summary.txt (each step: status, seconds), doctor.txt, pytest.xml,
# bench.md, bench.json. Exit status 0 when every step passed.
set -u
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${OUT:-$ROOT/test-output/gpu}
mkdir -p "$OUT"
PYTHON=${NBDIST_GPU_PYTHON:-python3}
WHEELS=${NBDIST_GPU_WHEELS:-$ROOT/.whl}
VENV=${NBDIST_GPU_VENV:-/tmp/nbdist-gpu}
BUDGET=${NBDIST_GPU_CHECK_S:-450}
START=$(date +%s)
export PYTHONUNBUFFERED=1 PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
exec > >(tee -a "$OUT/check.log") 2>&1
: >"$OUT/summary.txt"
FAILED=0

# step NAME CAP_S RESERVE_S: run the function NAME bounded by CAP_S, and by what the budget
# leaves after RESERVE_S for the steps behind it; record the outcome in summary.txt.
step() {
    local name=$1 cap=$2 reserve=$3
    local left=$((BUDGET - ($(date +%s) - START) - reserve))
    local limit=$((cap < left ? cap : left))
    if [ "$limit" -lt 10 ]; then
        echo "== $name: skipped, the time budget is spent" | tee -a "$OUT/summary.txt"
        FAILED=1
        return
    fi
    echo "== $name (at most ${limit} s) $(date -u +%T)"
    local t0=$(date +%s) rc
    timeout -k 10 "$limit" bash -o pipefail -c "$name"
    rc=$?
    local took=$(($(date +%s) - t0))
    local what="ok"
    [ "$rc" -eq 0 ] || { what="FAILED (exit $rc$([ "$rc" -eq 124 ] && echo ', timed out'))"; FAILED=1; }
    printf '%-10s %-28s %4d s\n' "$name" "$what" "$took" | tee -a "$OUT/summary.txt"
}

facts() {
    nvidia-smi --query-gpu=index,name,pci.bus_id,driver_version,memory.total --format=csv || true
    uname -srm
    "$PYTHON" - <<'EOF'
import importlib.metadata as md, sys
print("python", sys.version.split()[0], sys.executable)
for dist in ("torch", "cupy-cuda13x", "cupy-cuda12x", "nvidia-nccl-cu13", "nvidia-nccl-cu12",
             "mpi4py", "pybind11", "scikit-build-core", "cmake", "ninja", "pytest", "pytest-timeout"):
    try:
        print(f"{dist:20s} {md.version(dist)}")
    except md.PackageNotFoundError:
        pass
import torch
print("torch CUDA", torch.version.cuda, "| GPUs", torch.cuda.device_count(),
      [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
      "| torch's NCCL", torch.cuda.nccl.version() if torch.cuda.is_available() else "-")
EOF
    command -v c++ g++ nvcc cmake ninja || true
}

make_venv() {
    set -e
    if [ -x "$VENV/bin/python" ] && [ -f "$VENV/.wheels-installed" ]; then
        echo "reusing $VENV"
        return 0
    fi
    ls "$WHEELS"/*.whl >/dev/null || { echo "no wheels in $WHEELS: run tests/gpu/fetch_wheels.sh and carry .whl"; return 1; }
    # A venv of the image's base interpreter that also sees the image's packages (torch,
    # CuPy, NCCL, pytest) after its own: mpich's mpiexec and libmpi live under its prefix,
    # where mpi4py looks, and the tests' kernels and ranks run its bin/python.
    local image_sites venv_site
    image_sites=$("$PYTHON" -c 'import os, sys; print(repr([p for p in sys.path if os.path.isdir(p) and os.path.basename(p) in ("site-packages", "dist-packages")]))')
    "$PYTHON" -m venv --without-pip --clear "$VENV"
    venv_site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "import site; list(map(site.addsitedir, $image_sites))" >"$venv_site/_nbdist_image.pth"
    "$VENV/bin/python" -c 'import torch, pytest, pip; print("the venv sees torch", torch.__version__)'
    "$VENV/bin/python" -m pip install -q --no-index --no-deps --ignore-installed --no-compile \
        --no-cache-dir "$WHEELS"/*.whl
    touch "$VENV/.wheels-installed"
}

build() {
    "$VENV/bin/python" -m pip install --no-index --no-deps --no-build-isolation -e "$ROOT" &&
        "$VENV/bin/python" -c "from nbdist import _native; print('built', _native.__file__)"
}

doctor() {
    {
        echo "\$ nbdist doctor"
        "$VENV/bin/nbdist" doctor
        echo
        echo "\$ mpiexec -n 2 nbdist doctor"
        "$VENV/bin/mpiexec" -n 2 "$VENV/bin/nbdist" doctor
    } 2>&1 | tee "$OUT/doctor.txt"
}

gpu_tests() {
    "$VENV/bin/python" -m pytest -v -rs -p no:cacheprovider --timeout 300 \
        --junitxml "$OUT/pytest.xml" tests/test_gpu_nccl.py tests/test_gpu_pinning.py \
        tests/test_torch_cuda.py  # last: its final test starts MPI inside pytest itself
}

bench() {
    local gpus
    gpus=$("$VENV/bin/python" -c 'import torch; print(torch.cuda.device_count())')
    "$VENV/bin/mpiexec" -n "${gpus:-1}" "$VENV/bin/python" benchmarks/gpu_nccl.py \
        --json "$OUT/bench.json" --markdown "$OUT/bench.md"
}

export ROOT OUT PYTHON WHEELS VENV
export -f facts make_venv build doctor gpu_tests bench
echo "nbdist GPU check, $(date -u +%FT%TZ), $(git -C "$ROOT" log -1 --format='%h %s' 2>/dev/null | cut -c1-100)"
step facts 30 300
step make_venv 120 260
step build 240 200
step doctor 60 180
step gpu_tests 330 60
step bench 150 0
echo "== total $(($(date +%s) - START)) s; logs in $OUT"
cat "$OUT/summary.txt"
sleep 1  # let tee finish writing check.log before the files are collected
exit $FAILED
