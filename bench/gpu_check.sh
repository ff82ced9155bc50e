#!/usr/bin/env bash
# The GPU checks of a lent device machine, in one call: the GPU tests, then bench/gpu.py.
#   bash bench/gpu_check.sh [BENCH_ARGS...]   # e.g. --ppo_runs plain,offload --sft_runs plain,profile
# Made for the lent machines (PyTorch and transformers, no vLLM, no registry; a plain python3),
# where device time is counted by the second: each part has a time limit of its own, so one that
# hangs leaves time for the rest, and every log goes to $OUT (or /tmp/gpu_check) as it is written,
# so a call cut short still brings back what ran. TESTS_S and BENCH_S override the limits; by
# default they add up to 540 s, inside one 600 s device call (the tests took 105-109 s on an H100).
# Without arguments the bench runs SFT and one plain PPO run: its three PPO runs took longer than
# a call allows (BENCH_ARGS choose others, e.g. --ppo_runs offload).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/machine.txt"
python3 -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', \
torch.__version__, 'transformers', transformers.__version__)" | tee -a "$out/machine.txt"

# The GPU tests are tiny models, one rank each: on one GPU they run side by side (pytest-xdist,
# when the machine has it; -o addopts="" drops pytest.ini's CPU settings).
parallel=()
if python3 -c "import xdist" 2>/dev/null; then parallel=(-n 4); fi
start=$(date +%s)
timeout "${TESTS_S:-200}" python3 -m pytest -o addopts="" "${parallel[@]}" -rA -q \
  --durations=0 tests/test_gpu.py 2>&1 | tee "$out/test_gpu.log" | tail -40
echo "tests: exit ${PIPESTATUS[0]}, $(($(date +%s) - start)) s" | tee -a "$out/machine.txt"

start=$(date +%s)
bench_args=("$@")
if [ ${#bench_args[@]} -eq 0 ]; then bench_args=(--ppo_runs plain); fi
timeout "${BENCH_S:-340}" python3 bench/gpu.py --out /tmp/gpubench "${bench_args[@]}" 2>&1 |
  tee "$out/bench_gpu.log" | tail -20
echo "bench: exit ${PIPESTATUS[0]}, $(($(date +%s) - start)) s" | tee -a "$out/machine.txt"
rm -rf /tmp/gpubench
