#!/usr/bin/env bash
# Builds DeepEP (the real one: deepseek-ai/DeepEP, its V1 intranode, internode and low-latency
# kernels with NVSHMEM) as a wheel for the GPU machines: CPython 3.12, torch 2.11 (CUDA 13, what
# those machines have), sm_90. The wheel lands in .deepep/ at the root of the git checkout you run
# it from (kept out of git). The GPU machines reach no package index: carry .deepep and run
#   pip install --no-deps --no-index --target /tmp/deepep .deepep/*.whl
#   export PYTHONPATH=/tmp/deepep:$PYTHONPATH
#   export LD_LIBRARY_PATH=$(python3 -c "import nvidia.nvshmem as m; print(list(m.__path__)[0])")/lib:$LD_LIBRARY_PATH
# Usage: tools/make-deepep.sh DEEPEP_SOURCE_DIR   (a checkout or `git archive` export of DeepEP; the wheel
# in use was built from commit 567632d). Needs python3.12 and CUDA 13 (CUDA_HOME, default /usr/local/cuda); the first run makes a venv
# with torch 2.11 from PyPI (a CUDA 13 build, several GB; DEEPEP_VENV names another).
set -euo pipefail
src=$(cd "${1:?usage: tools/make-deepep.sh DEEPEP_SOURCE_DIR}" && pwd)
root=$(git rev-parse --show-toplevel)
out="$root/.deepep"
exclude="$(git -C "$root" rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")" "$out"
grep -qxF '/.deepep/' "$exclude" 2>/dev/null || echo '/.deepep/' >> "$exclude"
venv=${DEEPEP_VENV:-$HOME/.cache/deepep-venv312}
if [ ! -x "$venv/bin/python" ]; then
  python3.12 -m venv "$venv"
  "$venv/bin/pip" install -q torch==2.11.0 setuptools wheel ninja numpy
fi
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
cp -r "$src/." "$build"
cd "$build"
# NVSHMEM: setup.py finds the venv's nvidia-nvshmem-cu13 itself (and its library's versioned name).
# The host compiler needs what nvcc finds by itself: libcu++ (cuda/std/..., under include/cccl in
# CUDA 13) for NVSHMEM's headers, and torch's CUDA libraries' headers (cuSPARSE, cuBLAS: the venv's
# nvidia/cu13, which a toolkit of nvcc alone lacks).
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
cu=$("$venv/bin/python" -c "import nvidia.cu13 as m; print(list(m.__path__)[0])")
export CPATH="$CUDA_HOME/include/cccl:$cu/include${CPATH:+:$CPATH}"
# -lcuda: the driver, absent on a machine without a GPU. An empty stand-in named as the driver's
# library (libcuda.so.1) satisfies the linker; the GPU machine's driver provides the symbols when
# the module loads. --no-as-needed keeps the stand-in's name in the module although it resolves no
# symbol (dropped, the module fails to load there: "undefined symbol: cuMemAddressFree").
mkdir -p "$build/stubs"
if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so '; then
  echo > "$build/stubs/empty.c" && gcc -shared -Wl,-soname,libcuda.so.1 -o "$build/stubs/libcuda.so" "$build/stubs/empty.c"
fi
export LIBRARY_PATH="$cu/lib:$build/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}"
export LDFLAGS="-Wl,--no-as-needed${LDFLAGS:+ $LDFLAGS}"
TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-2} "$venv/bin/python" setup.py -q bdist_wheel -d "$out"
module=$(find "$build/build" -name 'deep_ep_cpp*.so' | head -1)
readelf -d "$module" | grep -q 'NEEDED.*\[libcuda\.so\.1\]' || { echo "$module: libcuda.so.1 not among its libraries" >&2; exit 1; }
ls -la "$out"
