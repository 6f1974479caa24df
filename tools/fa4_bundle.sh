#!/usr/bin/env bash
# Pack FlashAttention-4 and its CuTe DSL runtime (python 3.12, x86-64, CUDA 13) into ONE archive
# for a GPU machine that cannot install packages and takes at most 64 MiB of files: the cu13
# library wheel alone is 92 MB zipped; xz with the x86 branch filter and a dictionary larger than
# its 188 MB library brings everything to ~55 MiB. Takes ~6 minutes on 2 cores. Keep the output
# git-ignored.
#
#   bash tools/fa4_bundle.sh [.fa4]          # -> .fa4/fa4.tar.xz
#
# On the GPU machine, before benchmarks/gpu_fa4.py or `spanattn bench` with FA4:
#   python3 -c "import tarfile; tarfile.open('.fa4/fa4.tar.xz').extractall('/tmp/fa4site')"
#   export PYTHONPATH=$PWD:/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages
set -euo pipefail
dir=${1:-.fa4}
wheels=$dir/wheels
mkdir -p "$wheels"
pkgs=(flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
  nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5
  torch-c-dlpack-ext==0.1.5 apache-tvm-ffi==0.1.15.post2)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d "$wheels" "${pkgs[@]}"
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
for w in "$wheels"/*.whl; do python3 -m zipfile -e "$w" "$stage"; done
# C sources and a profiler injection library: never imported by the forward pass
rm -rf "$stage/tvm_ffi/3rdparty" "$stage/nvidia_cutlass_dsl/dsl_packages/iket/profiler"
(cd "$stage" && tar cf - .) | xz --x86 --lzma2=preset=9e,dict=256MiB -T1 >"$dir/fa4.tar.xz"
ls -l "$dir/fa4.tar.xz"
