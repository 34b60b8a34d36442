#!/usr/bin/env bash
# Build Horovod (PyTorch, Gloo, CPU only: no MPI, NCCL or TensorFlow) from source and install
# it into the current Python, so that `hora bench`, training_scaling.py and startup.py run
# it beside hora.  PyPI's horovod 0.28.1 does not build against torch >= 2.1; its master
# does, once the torch extension is compiled as C++20 (torch >= 2.10's headers need it).
#
#   bash benchmarks/install_horovod.sh [SOURCE_DIR]
#
# SOURCE_DIR: a checkout of github.com/horovod/horovod with its submodules (default: clone
# it, recursively, into $TMPDIR/horovod-src).  Needs git, cmake, g++ and the installed torch;
# takes about 4 minutes on 2 cores.  Installs with --no-deps (plus psutil, which Horovod
# imports), so torch and numpy stay as they are.
set -euo pipefail
src=${1:-${TMPDIR:-/tmp}/horovod-src}
if [ ! -d "$src/horovod" ]; then
    git clone --recursive https://github.com/horovod/horovod "$src"
fi
cmake_file="$src/horovod/torch/CMakeLists.txt"
if ! grep -q 'VERSION_GREATER_EQUAL "2.10"' "$cmake_file"; then
    python - "$cmake_file" <<'EOF'
import sys
path = sys.argv[1]
text = open(path).read()
old = 'if(Pytorch_VERSION VERSION_GREATER_EQUAL "2.1")\n'
new = ('if(Pytorch_VERSION VERSION_GREATER_EQUAL "2.10")\n'
       '    set(CMAKE_CXX_STANDARD 20)\n'
       '    set(Pytorch_CXX17 TRUE)\n'
       'elseif(Pytorch_VERSION VERSION_GREATER_EQUAL "2.1")\n')
if old not in text:
    sys.exit(f"{path}: the torch version switch is not where this script expects it")
open(path, "w").write(text.replace(old, new, 1))
EOF
fi
dist=$(mktemp -d)
(
    cd "$src"
    export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
           HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_GPU_OPERATIONS= \
           HOROVOD_CPU_OPERATIONS=gloo MAKEFLAGS=-j"$(nproc)"
    python setup.py -q bdist_wheel -d "$dist"
)
pip install --no-deps "$dist"/horovod-*.whl
pip install psutil
python -c "import horovod.torch as hvd; hvd.init(); print('horovod.torch: gloo built', hvd.gloo_built(), 'size', hvd.size())"
