#!/usr/bin/env bash
# funcoll's CUDA checks on a machine with one GPU, in one go: the CUDA tests, then the GPU benchmarks.
#
# Run from the repository root: bash benchmarks/cuda.sh [OUTDIR [STEP...]]
# (OUTDIR default: $OUT, else cuda-results; STEP: any of the step names below, default all)
# Each step has its own time limit, so one that hangs cannot take the others' time; each
# writes its log to OUTDIR. funcoll runs from the checkout (PYTHONPATH), nothing is installed.
#
# - tests/test_kernels.py, the single-process cases: the Triton row kernels compiled for
#   the GPU against row-by-row references (the multi-rank cases run gloo on CPU tensors,
#   interpreted, as on a machine without one: tests/test_kernels.py);
# - benchmarks/bench_row_kernels.py: the Triton pad and cut against funcoll's torch-op path;
# - benchmarks/bench_moe_cuda.py: funcoll.moe against the torchtitan-style recipe, bf16,
#   with grouped-GEMM experts, host syncs counted by CUDA;
# - tests/test_cuda.py: the deferred wait on a one-rank NCCL group, and the ops on CUDA
#   tensors over 2 and 3 NCCL ranks, eager and inductor (where the machine has a GPU a rank);
# - benchmarks/bench_overlap_cuda.py: a collective on NCCL's stream beside matmuls on the
#   compute stream, funcol beside funcoll's primitives, eager and inductor with its overlap passes;
# - benchmarks/bench_torchtitan_cuda.py: torchtitan's MoE layer with its dispatcher and with
#   funcoll's, bf16 grouped GEMMs, eager (two token counts, two expert forms), then compiled.
# torchtitan and what it imports travel as wheels in .whl/ where the machine has no package
# index: `pip download --no-deps -d .whl torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17
# docstring-parser typeguard` (see bench_torchtitan.py); they are installed under /tmp/funcoll-site.
set -u
out=${1:-${OUT:-cuda-results}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONWARNINGS=ignore::DeprecationWarning  # torch.jit's, once per spawned rank
export PYTORCH_NVML_BASED_CUDA_CHECK=1  # is_available() without initializing CUDA before a fork
shift $(($# > 0 ? 1 : 0))
only=" $* "
step() {  # step NAME SECONDS COMMAND...: run it under a limit, log it, say how it ended
    local name=$1 limit=$2; shift 2
    if [ "$only" != "  " ] && [[ "$only" != *" $name "* ]]; then return; fi
    local t0=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc in $((SECONDS - t0)) s"
    tail -n 40 "$out/$name.log"
}
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/funcoll-site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/funcoll-site"
fi
{ nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } 2>&1
step test_kernels 120 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_kernels.py -k "not test_ops_on_the_kernels"
step bench_row_kernels 80 python3 benchmarks/bench_row_kernels.py
step bench_moe_cuda 110 python3 benchmarks/bench_moe_cuda.py
step test_cuda 285 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_cuda.py
step bench_overlap_cuda 170 python3 benchmarks/bench_overlap_cuda.py --modes eager inductor+overlap
step bench_torchtitan_cuda 100 python3 benchmarks/bench_torchtitan_cuda.py --no-compile
step bench_torchtitan_cuda_compiled 170 python3 benchmarks/bench_torchtitan_cuda.py --tokens 16384 --experts grouped
