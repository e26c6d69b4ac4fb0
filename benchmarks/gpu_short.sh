#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md's targets in one run of under 10 minutes on one CUDA GPU: EVHub-v0's step at
# 4,096 and 65,536 envs (eager, compiled as one graph, that graph replayed by CUDA), its kernel launches per step
# (torch.profiler), then `doit run pipeline` with the agents compiled and graphed (each agent's SPS is in its
# train.log). `doit bench part=gpu` measures all of it and more, in well over half an hour.
#
#   bash benchmarks/gpu_short.sh OUT_DIR [LIMIT_S [WHEELHOUSE]]     # from the repository root
#
# WHEELHOUSE: a folder of `doit wheelhouse` (the dependencies but torch) for a machine without network whose torch is
# installed: the project is installed from it first (pip --no-index), its time counted in the limit.
# OUT_DIR gets gpu_short.log (everything printed, each line with the seconds since the start), the env and profile
# tables, the pipeline's co2_comparison.parquet and report.md. The pipeline runs in outputs/ as usual and is stopped
# when the whole script has run LIMIT_S seconds (default 580), leaving the lines it printed so far.
# EVHUB_GPU_SLOTS=k in the environment lets k agents share the GPU (docs/cluster.md).
set -u
out=${1:?usage: bash benchmarks/gpu_short.sh OUT_DIR [LIMIT_S [WHEELHOUSE]]}
deadline=$(( $(date +%s) + ${2:-580} ))
wheelhouse=${3:-}
mkdir -p "$out"
work=$(mktemp -d)
export PYTHONUNBUFFERED=1

stamp() {  # prefix each line with the seconds since the script started
    python3 -u -c '
import sys, time
t0 = float(sys.argv[1])
for line in sys.stdin:
    sys.stdout.write(f"{time.time() - t0:7.1f}  {line}")
' "$t0"
}
t0=$(date +%s.%N)

{
    if [ -n "$wheelhouse" ]; then
        echo "== offline install from $wheelhouse"
        python3 -m pip install -q --no-index --find-links "$wheelhouse" --no-build-isolation -e . || exit 1
    fi
    echo "== device"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name())"
    nproc

    echo "== env throughput: EVHub-v0 at 4,096 and 65,536 envs, eager / compiled / CUDA graph"
    timeout 150 python3 -m benchmarks.env_throughput --device cuda --num-envs 4096 65536 \
        --impls ours ours_compile ours_cudagraph --repeats 3 --min-seconds 0.5 --out-dir "$work/env"
    cp "$work"/env/*.parquet "$out"/ 2>/dev/null

    echo "== kernel launches per env step (65,536 envs)"
    timeout 90 python3 -m benchmarks.profile --targets env_eager env_compile env_cudagraph --device cuda \
        --num-envs 65536 --out-dir "$work/profile"
    cp "$work"/profile/*.parquet "$out"/ 2>/dev/null

    limit=$(( deadline - $(date +%s) - 10 ))
    echo "== doit run pipeline (agents: --compile --cudagraphs; gpu_slots ${EVHUB_GPU_SLOTS:-1}), limit ${limit} s"
    start=$SECONDS
    timeout "$limit" env EVHUB_ALGO_ARGS="--compile --cudagraphs" python3 -m doit run pipeline
    echo "pipeline: exit $?, $((SECONDS - start)) s"
    echo "== the agents' speed (their train.log)"
    for f in outputs/caltech/runs/*/train.log; do
        echo "-- $f"
        grep -iE "sps|steps/s|compil|error" "$f" | tail -n 6
    done
    cp outputs/caltech/report/co2_comparison.parquet outputs/caltech/report/report.md "$out"/ 2>/dev/null
} 2>&1 | stamp | tee "$out/gpu_short.log"
