#!/usr/bin/env bash
# Every GPU check the project owes, in parts that each fit a 10-minute command, so a short
# loan of a GPU machine is spent measuring, not typing. Run from the project root on a machine
# with an NVIDIA GPU, CUDA torch, Ray, DeepSpeed, redis-server and (for the vllm parts) vLLM:
#
#   bash bench/gpu.sh tests          # pytest -m gpu: learner on CUDA, both engines, 1-GPU runs
#   bash bench/gpu.sh quickstart     # staleflow train configs/quickstart-gpu.yaml (vLLM)
#   bash bench/gpu.sh pipeline-vllm  # bench/pipeline.py, SmolLM2, lock-step vs async, vLLM
#   bash bench/gpu.sh pipeline-hf    # the same with the hf engine
#   bash bench/gpu.sh pipeline-ipc   # pipeline-vllm with sync.method ipc (CUDA IPC)
#   bash bench/gpu.sh pipeline-mps   # pipeline-ipc under NVIDIA MPS (kernels of the learner and
#                                    # vLLM run at once instead of time-sliced)
#   bash bench/gpu.sh sync           # bench/sync.py: weight publish + load, SmolLM2
#   bash bench/gpu.sh vllm-load      # bench/vllm_load.py: vLLM's load, shm vs rpc transport
#   bash bench/gpu.sh flatten        # bench/flatten.py: the publish's per-tensor copy vs one cat
#   bash bench/gpu.sh all            # every part, one after the other
#
# Each part writes PART.log under $OUT (default ./gpu-results; the quickstart also its run
# directory, less checkpoints and Redis data), ends with a line "== PART: rc=N in S s", and
# is cut at its own time limit (PART_LIMIT_S, default 540 s): one hang never eats the next.
# The pipeline parts run PIPELINE_STEPS steps per schedule (default 20).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

usage="usage: bash bench/gpu.sh tests|quickstart|pipeline-vllm|pipeline-hf|pipeline-ipc|pipeline-mps|sync|vllm-load|flatten|all"
part=${1:?$usage}
out=${OUT:-gpu-results}
limit=${PART_LIMIT_S:-540}
steps=${PIPELINE_STEPS:-20}
python=${PYTHON:-python3}
parts="tests quickstart pipeline-vllm pipeline-hf pipeline-ipc pipeline-mps sync vllm-load flatten"
case " $parts all " in
    *" $part "*) ;;
    *) echo "bench/gpu.sh: unknown part '$part'" >&2; echo "$usage" >&2; exit 2 ;;
esac
mkdir -p "$out"

if ! nvidia-smi >"$out/nvidia-smi.txt" 2>&1; then
    echo "bench/gpu.sh: nvidia-smi failed (see $out/nvidia-smi.txt): no GPU to measure on" >&2
    exit 2
fi

# run NAME COMMAND...: COMMAND under `timeout`, its output shown and kept in $out/NAME.log.
run() {
    local name=$1 start=$SECONDS rc
    shift
    echo "== $name: $*" | tee "$out/$name.log"
    timeout --kill-after=20 "$limit" "$@" 2>&1 | tee -a "$out/$name.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 124 ] && echo "== $name: cut at ${limit} s (PART_LIMIT_S)" | tee -a "$out/$name.log"
    echo "== $name: rc=$rc in $((SECONDS - start)) s" | tee -a "$out/$name.log"
    return "$rc"
}

# One GPU shared the way configs/quickstart-gpu.yaml shares it: learner 0.5, one worker 0.5.
share=(--workers 1 --gpus-per-rank 0.5 --gpus-per-worker 0.5)

one() {
    case $1 in
        tests) STALEFLOW_REQUIRE_VLLM=1 run tests "$python" -m pytest -m gpu -q -p no:cacheprovider ;;
        quickstart)
            # the CLI of $python's environment, not whichever `staleflow` PATH finds first
            run quickstart "$python" -c 'from staleflow.cluster.cli import main; raise SystemExit(main())' \
                train configs/quickstart-gpu.yaml \
                "run.output_dir=$out/runs" run.checkpoint_every=0
            local rc=$?
            rm -rf "$out"/runs/*/checkpoints "$out"/runs/*/redis  # hundreds of MB, not results
            return "$rc" ;;
        pipeline-vllm)
            run pipeline-vllm "$python" bench/pipeline.py --model smollm2 --engine vllm \
                --steps "$steps" "${share[@]}" ;;
        pipeline-hf)
            run pipeline-hf "$python" bench/pipeline.py --model smollm2 --engine hf \
                --steps "$steps" "${share[@]}" ;;
        pipeline-ipc)
            run pipeline-ipc "$python" bench/pipeline.py --model smollm2 --engine vllm \
                --steps "$steps" --sync-method ipc "${share[@]}" ;;
        pipeline-mps)
            # MPS lets the two processes' kernels share the GPU's SMs at once; without it the
            # GPU time-slices between their contexts. The daemon must start before any CUDA
            # process of the run (Ray's workers are started by the bench itself).
            local mps
            mps=$(command -v nvidia-cuda-mps-control || ls /usr/local/nvidia/bin/nvidia-cuda-mps-control 2>/dev/null)
            if [ -z "$mps" ]; then
                echo "== pipeline-mps: nvidia-cuda-mps-control not found: no MPS here" | tee "$out/pipeline-mps.log"
                return 2
            fi
            export CUDA_MPS_PIPE_DIRECTORY=/tmp/sf-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/sf-mps/log
            mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
            "$mps" -d || { echo "== pipeline-mps: the MPS daemon did not start" | tee "$out/pipeline-mps.log"; return 2; }
            run pipeline-mps "$python" bench/pipeline.py --model smollm2 --engine vllm \
                --steps "$steps" --sync-method ipc "${share[@]}"
            local rc=$?
            echo quit | "$mps"
            cat "$CUDA_MPS_LOG_DIRECTORY"/control.log >>"$out/pipeline-mps.log" 2>/dev/null
            return "$rc" ;;
        sync) run sync "$python" bench/sync.py --model smollm2-135m ;;
        vllm-load) run vllm-load "$python" bench/vllm_load.py --model smollm2-135m ;;
        flatten) run flatten "$python" bench/flatten.py --model smollm2-135m --rounds 21 ;;
        *) echo "$usage" >&2; return 2 ;;
    esac
}

if [ "$part" = all ]; then
    status=0
    for p in $parts; do
        one "$p" || status=1
    done
    exit "$status"
fi
one "$part"
