#!/usr/bin/env bash
# plainrlhf launcher.
#   ./launch.sh setup            create .venv/ and install the stack (idempotent; reused when current)
#   ./launch.sh demo             setup, then the main job on the embedded task: SFT, then PPO from it
#   ./launch.sh test [pytest args]   setup, ruff check + ruff format --check, then the test suite
#                                    (`-m "not slow"` for a quick run)
#   ./launch.sh pipeline         setup, then SFT -> reward model -> PPO against it (the rule logged as
#                                gold), with a summary; OUT_DIR (default runs/pipeline) holds the runs;
#                                SFT_ARGS, RM_ARGS, PPO_ARGS add flags to a stage (the later one wins)
#   ./launch.sh sft|rm|ppo|dpo [args]   torchrun train_sft.py / train_rm.py / train_ppo.py /
#                                       train_dpo.py: one process per GPU, or 2 on CPU
#   ./launch.sh plot RUN [PNG]   score, KL and accuracy curves of a run (matplotlib)
#
# Several nodes: set NNODES, MASTER_ADDR, MASTER_PORT on every node (torchrun's c10d rendezvous,
# hosted by the node whose address MASTER_ADDR is; it numbers the nodes itself, so no NODE_RANK).
# MAX_RESTARTS (default 0) restarts the whole group when a rank dies; a restarted run
# resumes from its latest checkpoint by itself. NPROC_PER_NODE overrides the process count.
set -euo pipefail
# A SIGTERM/SIGUSR1 before the first stage has started (during setup, or while torch is asked for
# the GPU count) stops the script as one between stages does: nothing started, exit 0.
trap 'STOPPED=1' TERM USR1
cd "$(dirname "$0")"
PY=.venv/bin/python

VLLM_GPU='vllm==0.32.*'  # a GPU machine's vLLM (CUDA torch comes with it); part of the marker

setup() {
  local want
  if command -v nvidia-smi >/dev/null 2>&1; then want="gpu $(sha256sum requirements.txt) $VLLM_GPU"; else want="cpu $(sha256sum requirements-cpu.txt)"; fi
  if [ -x "$PY" ] && [ "$(cat .venv/.installed 2>/dev/null)" = "$want" ]; then return; fi
  # Several nodes would install into one shared .venv at once (and compute nodes are often
  # offline): it is made once, beforehand, on a node of the kind that trains
  if [ "${NNODES:-1}" != 1 ]; then
    local why=".venv is missing or not current for this machine ($want)"
    echo "error: $why; run ./launch.sh setup once on one ${want%% *} node, then on every node" >&2
    exit 2
  fi
  # The pinned wheels are Python 3.11's. A venv of another Python, or without a working pip (cut
  # short, or made without ensurepip), is made anew, from a python3 that is 3.11.
  local py311='import sys; sys.exit(sys.version_info[:2] != (3, 11))'
  if ! { "$PY" -c "$py311" && "$PY" -m pip --version; } >/dev/null 2>&1; then
    if ! python3 -c "$py311" 2>/dev/null; then
      echo "error: ./launch.sh setup needs python3 3.11; python3 is $(python3 --version 2>&1)" >&2
      exit 1
    fi
    python3 -m venv --clear .venv
  fi
  if [ "${want%% *}" = gpu ]; then
    "$PY" -m pip install -r requirements.txt "$VLLM_GPU"
  else
    "$PY" -m pip install --no-deps -r requirements-cpu.txt
  fi
  # Smoke check: a broken torchvision breaks `import transformers`; vllm must import too.
  "$PY" -c "import torch, transformers, vllm; from transformers import LlamaConfig; from vllm import LLM; print('setup ok: torch', torch.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)"
  echo "$want" > .venv/.installed
}

# torchrun itself, without its launcher chatter: when a rank fails, the ranks have printed their
# one-line errors, and torchrun's report (a Python traceback and a failure table) says nothing more.
# One line is added only when the first rank to fail did not exit with our status 1 (a signal, a
# crash): then no line of ours explains it.
# SIGTERM and SIGUSR1 reach torchrun too where a scheduler signals every process of the job (SLURM
# signals a whole job step): torchrun would die of a USR1 and turn a TERM into a failure that
# SIGKILLs the ranks 30 s later. It lets both pass (a Python handler that does nothing: the ranks,
# exec-ed, start with the default action, not an inherited SIG_IGN; `--signals_to_handle` below
# keeps torchrun from setting its own), and ends when the ranks have saved and exited.
QUIET_TORCHRUN='
import logging
import os
import signal
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main

for name in list(logging.root.manager.loggerDict):
    if name.startswith("torch.distributed"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
for sig in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(sig, lambda *_: None)
os.environ["PLAINRLHF_LAUNCHER_PID"] = str(os.getpid())  # `common.watch_launcher`
try:
    main(sys.argv[1:])
except ChildFailedError as e:
    rank, failure = e.get_first_failure()
    if failure.exitcode != 1:
        print(f"error: rank {rank} failed first: {failure.message}", file=sys.stderr)
    sys.exit(1)
'

run_torchrun() {
  local script=$1; shift
  local nproc=${NPROC_PER_NODE:-}
  if [ -z "$nproc" ]; then
    nproc=$("$PY" -c "import torch; print(torch.cuda.device_count() or 2)")
  fi
  # A quiet console: OMP_NUM_THREADS=1 per process is torchrun's own default (set here, torchrun
  # does not print its banner about it); torch's C++ warnings read their level before any Python
  # runs, so it is set here too. Both are yours to override.
  # One node: a free port of the system's choosing (two runs on one machine never collide);
  # several nodes must agree on one, 29500 unless MASTER_PORT says otherwise.
  local port=${MASTER_PORT:-0}
  if [ "${NNODES:-1}" != 1 ]; then
    port=${MASTER_PORT:-29500}
    if [ -z "${MASTER_ADDR:-}" ]; then  # each node would wait for the others on its own loopback
      echo "error: NNODES=$NNODES needs MASTER_ADDR: one node's address (it hosts the" \
        "rendezvous), the same on every node" >&2
      return 2
    fi
    # Each node counts its own restarts, so with torchrun's store shared by every round the
    # nodes of a restarted group could not meet (`common.py: check_restarts_can_meet`); a store
    # of each round's own needs no count.
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
  fi
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  export TORCH_CPP_LOG_LEVEL=${TORCH_CPP_LOG_LEVEL:-ERROR}
  # Signalled between stages (demo, pipeline), or while the line above asked torch: not started.
  if [ -n "${STOPPED:-}" ]; then return 0; fi
  "$PY" -c "$QUIET_TORCHRUN" --nnodes="${NNODES:-1}" \
    --rdzv_backend=c10d --rdzv_endpoint="${MASTER_ADDR:-127.0.0.1}:$port" \
    --nproc_per_node="$nproc" --max-restarts="${MAX_RESTARTS:-0}" \
    --signals_to_handle=SIGINT,SIGHUP,SIGQUIT "$script" "$@" &
  local pid=$! rc=0 pending=
  # Preemption: SIGTERM/SIGUSR1 go to the training processes (torchrun's children). They finish the
  # step, save and exit 0, so torchrun and this script exit 0. A signal is passed on only to ranks
  # that have set their handler (`common.watch_signals`; SigCgt in /proc): it waits (`pending`)
  # while they import, which would have killed them, and with MAX_RESTARTS the restarted group
  # would have trained on as if no notice had come. One rank is enough: the ranks agree at the
  # step's end. STOPPED tells demo and pipeline not to start the next stage (it would need this
  # one's export).
  trap 'STOPPED=1; pending=TERM' TERM
  trap 'STOPPED=1; pending=USR1' USR1
  trap 'kill -INT "$pid" 2>/dev/null || true' INT  # Ctrl-C: torchrun stops its workers
  while kill -0 "$pid" 2>/dev/null; do
    if [ -n "$pending" ] && signal_ready_ranks "$pid" "$pending"; then pending=; fi
    # a trap runs once this returns: a signal is passed on within 0.2 s. `|| true`: a signal to
    # every process of the job reaches this sleep too, and under `set -e` its death ended the
    # script; the braces' 2>/dev/null takes bash's own "Terminated" line for it
    { sleep 0.2 || true; } 2>/dev/null
  done
  wait "$pid" && rc=0 || rc=$?
  # Between stages a signal only marks the stop (the traps above name this call's local pid).
  trap 'STOPPED=1' TERM USR1
  trap - INT
  return "$rc"
}

# Send signal $2 to those children of process $1 (torchrun's ranks) that catch it; false if none
# does yet. SigCgt in /proc/PID/status: the caught signals, a hex mask, bit N-1 for signal N.
signal_ready_ranks() {
  local number child mask sent=1
  number=$(kill -l "$2")
  for child in $(pgrep -P "$1" || true); do
    mask=$(awk '/^SigCgt:/ {print $2}' "/proc/$child/status" 2>/dev/null || true)
    if [ -n "$mask" ] && (( (16#$mask >> (number - 1)) & 1 )); then
      kill "-$2" "$child" 2>/dev/null && sent=0
    fi
  done
  return "$sent"
}

# demo and pipeline, after each stage: a stage stopped by SIGTERM/SIGUSR1 saved and exited 0; the
# next one is not started, and the script exits 0 (a rerun continues: every stage --resume latest).
stop_if_signalled() {
  if [ -n "${STOPPED:-}" ]; then
    echo "stopped by a signal before $1; run the same command again to go on"
    exit 0
  fi
}

cmd=${1:-}; shift || true
case "$cmd" in
  setup) NNODES=1 setup ;;  # asked for: installs on this node, whatever NNODES says
  test)  # the house style first (ruff.toml; tests/test_style.py has the rest), then the suite
    setup
    .venv/bin/ruff check .
    .venv/bin/ruff format --check .
    exec "$PY" -m pytest "$@" ;;
  demo)  # the SFT budget leaves PPO room to improve (README: measured numbers)
    setup
    # --resume latest: a second demo (or one that was stopped) continues; rm -rf runs/demo starts over
    # The demo keeps SFT's recipe from before the defaults changed (batch 64, no weight decay, 400
    # steps): its PPO settings and recorded numbers are for that start (README: the demo)
    run_torchrun train_sft.py --out_dir runs/demo/sft --max_steps 400 --train_batch_size 64 \
      --weight_decay 0 --resume latest
    stop_if_signalled PPO
    run_torchrun train_ppo.py --model runs/demo/sft/hf --out_dir runs/demo/ppo --resume latest
    stop_if_signalled "the summary"
    "$PY" - <<'PY'
import json
acc = lambda p: [r["eval/accuracy"] for r in map(json.loads, open(p)) if "eval/accuracy" in r]
print(f"held-out accuracy: after SFT {acc('runs/demo/sft/metrics.jsonl')[-1]:.3f}, after PPO {acc('runs/demo/ppo/metrics.jsonl')[-1]:.3f}")
PY
    ;;
  pipeline)  # the three stages of InstructGPT on the embedded task (README: measured numbers)
    setup
    out=${OUT_DIR:-runs/pipeline}
    # --resume latest: a stopped pipeline continues where it stopped; rm -rf "$out" starts over
    t0=$(date +%s)
    # ${X_ARGS:-} unquoted on purpose: split into flags (argparse keeps the last of a repeated one)
    run_torchrun train_sft.py --out_dir "$out/sft" --resume latest ${SFT_ARGS:-}
    stop_if_signalled "the reward model"
    t1=$(date +%s)
    run_torchrun train_rm.py --model "$out/sft/hf" --out_dir "$out/rm" --resume latest ${RM_ARGS:-}
    stop_if_signalled PPO
    t2=$(date +%s)
    # 50 iterations at --lr 2e-5: SFT's weight decay leaves small weights, which PPO's default
    # 1e-4 moves too far per step (README: the pipeline); 50 keep the pipeline near 11 minutes
    run_torchrun train_ppo.py --model "$out/sft/hf" --reward_model "$out/rm/hf" \
      --gold_reward_fn task:reward_fn --out_dir "$out/ppo" --max_steps 50 --lr 2e-5 \
      --resume latest ${PPO_ARGS:-}
    stop_if_signalled "the summary"
    t3=$(date +%s)
    "$PY" - "$out" "$t0" "$t1" "$t2" "$t3" <<'PY'
import json
import sys

out, t0, t1, t2, t3 = sys.argv[1], *map(int, sys.argv[2:])
def last(stage, key, first=False):
    rows = [r[key] for r in map(json.loads, open(f"{out}/{stage}/metrics.jsonl")) if key in r]
    return rows[0] if first else rows[-1]
print(f"SFT: held-out accuracy {last('sft', 'eval/accuracy'):.3f} ({t1 - t0} s)")
print(f"RM:  held-out pair accuracy {last('rm', 'eval/accuracy'):.3f} ({t2 - t1} s)")
start, end = last("ppo", "eval/gold_accuracy", first=True), last("ppo", "eval/gold_accuracy")
print(f"PPO: held-out gold accuracy {start:.3f} -> {end:.3f} ({end - start:+.3f}; {t3 - t2} s)")
print(f"pipeline: {t3 - t0} s")
PY
    ;;
  sft) setup; run_torchrun train_sft.py "$@" ;;
  rm) setup; run_torchrun train_rm.py "$@" ;;
  ppo) setup; run_torchrun train_ppo.py "$@" ;;
  dpo) setup; run_torchrun train_dpo.py "$@" ;;
  plot) setup; exec "$PY" plot.py "$@" ;;
  *) echo "usage: ./launch.sh setup|demo|pipeline|test|sft|rm|ppo|dpo|plot [args]" >&2; exit 2 ;;
esac
