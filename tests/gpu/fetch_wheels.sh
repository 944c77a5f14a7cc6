#!/usr/bin/env bash
# Fetch what tests/gpu/check.sh installs on a GPU machine that has no network: the wheels
# of tests/gpu/wheels.txt for CPython 3.12 on manylinux x86-64 (the device image's Python),
# into .whl/ at the repository root, which git ignores (.git/info/exclude), so that the
# device tool carries it only when `carry` names it. Run here, where pip reaches an index:
#
#     bash tests/gpu/fetch_wheels.sh            # about 32 MiB
#
# Other Python versions: NBDIST_GPU_PYTHON_VERSION=3.11 bash tests/gpu/fetch_wheels.sh
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
dest=${NBDIST_GPU_WHEELS:-.whl}
pyver=${NBDIST_GPU_PYTHON_VERSION:-3.12}

exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
if [ "$dest" = .whl ] && ! grep -qx '/.whl/' "$exclude" 2>/dev/null; then
    echo '/.whl/' >>"$exclude"
fi

rm -rf "$dest"  # one version of each: a stale second version stops the whole install
mkdir -p "$dest"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$dest" -r tests/gpu/wheels.txt

wanted=$(grep -cv '^\s*\(#\|$\)' tests/gpu/wheels.txt)
got=$(ls "$dest"/*.whl | wc -l)
[ "$got" -eq "$wanted" ] || { echo "expected $wanted wheels in $dest, got $got" >&2; exit 1; }

# The device tool carries at most 64 MiB per call: the tracked tree plus the wheels.
wheels=$(du -sb "$dest" | cut -f1)
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
total=$((wheels + tree))
echo "$got wheels, $((wheels / 1048576)) MiB; with the tracked tree $((total / 1048576)) MiB of the 64 MiB limit"
[ "$total" -lt $((64 * 1048576)) ] || { echo "too large to carry" >&2; exit 1; }
