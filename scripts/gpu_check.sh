#!/usr/bin/env bash
# lockstep on a CUDA machine in a few minutes; one line per check: PASS|FAIL|SKIP name: detail
#
#   scripts/gpu_check.sh                   # on CUDA: every check
#   scripts/gpu_check.sh --device cpu      # the same checks on the CPU (gloo)
#   scripts/gpu_check.sh --device cpu --quick   # 2-step runs, no 2-process pretrain, no colocated RL
#                                               # (what tests/test_gpu_check.py runs)
#
# Checks: a debug pretrain with a checkpoint (1 process; 2 over torchrun when there are 2 GPUs, or
# on the CPU), `lockstep generate` from its run directory, scripts/gpu_checks.py (transformers
# parity, batch invariance, checkpoint staging, weight-sync buffer), and rl-debug runs (trainer +
# generator process; one colocated process). PYTHON overrides the interpreter (default
# .venv/bin/python, else python3). Exit status 1 if any check failed; logs stay in the printed
# work directory when one did.
set -u
cd "$(dirname "$0")/.."

DEVICE=cuda
QUICK=0
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="${2:-}"; shift 2 ;;
    --device=*) DEVICE="${1#*=}"; shift ;;
    --quick) QUICK=1; shift ;;
    -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$DEVICE" in
  cuda|cpu) ;;
  *) echo "gpu_check.sh: --device must be cuda or cpu, got '$DEVICE'" >&2; exit 2 ;;
esac
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
WORK="$(mktemp -d "${TMPDIR:-/tmp}/lockstep-gpu-check.XXXXXX")"
LIMIT=600          # seconds any one command may take
if [ "$QUICK" = 1 ]; then STEPS=2; RL_STEPS=2; else STEPS=20; RL_STEPS=3; fi
FAILED=0

line() {  # status name detail
  echo "$1 $2: $3"
  if [ "$1" = FAIL ]; then FAILED=$((FAILED + 1)); fi
  return 0
}

# run NAME RUN_DIR COMMAND...: PASS with the run's summary lines, FAIL with the log's last line;
# on CUDA the run's manifest must record a cuda device
run() {
  local name="$1" dir="$2"; shift 2
  local log="$WORK/$name.log" start=$SECONDS code=0
  timeout "$LIMIT" "$@" >"$log" 2>&1 || code=$?
  local took="[$((SECONDS - start))s]"
  if [ "$code" != 0 ]; then
    line FAIL "$name" "exit $code: $(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-200) (log: $log) $took"
  elif [ "$DEVICE" = cuda ] && ! grep -q '"device": *"cuda' "$dir/manifest.json" 2>/dev/null; then
    line FAIL "$name" "ran, but $dir/manifest.json records no cuda device (log: $log) $took"
  else
    local summary
    summary="$(grep -E 'final train loss|validation loss|^reward|logprob_diff' "$log" | awk 'NR > 1 { printf "; " } { printf "%s", $0 }')"
    line PASS "$name" "${summary:-finished} $took"
  fi
}

if [ "$DEVICE" = cuda ]; then
  GPUS="$(nvidia-smi -L 2>/dev/null | wc -l)"
  if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    line FAIL cuda "$PY: torch sees no CUDA device (install a CUDA build of torch; see README 'GPUs')"
    exit 1
  fi
  echo "# $("$PY" -c 'import torch; print(f"torch {torch.__version__}, {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")'), work dir $WORK"
else
  GPUS=0
  echo "# CPU run ($("$PY" -c 'import torch; print(torch.__version__)')), work dir $WORK"
fi

TRAIN=(-m lockstep.cli train --recipe debug --training.device "$DEVICE" --steps "$STEPS" --checkpoint-every "$STEPS"
       --output.no-progress)
run pretrain-1proc "$WORK/train1" "$PY" "${TRAIN[@]}" --run-dir "$WORK/train1"
# the pretrained run directory through `lockstep generate` on the device
start=$SECONDS
if out="$(timeout "$LIMIT" "$PY" -m lockstep.cli generate --checkpoint "$WORK/train1" --device "$DEVICE" \
          --prompt "ROMEO:" --max-new-tokens 8 --ignore-eos --json 2>"$WORK/generate.log")" \
   && n="$(printf '%s' "$out" | "$PY" -c 'import json, sys; print(len(json.load(sys.stdin)["token_ids"]))')" \
   && [ "$n" = 8 ]; then
  line PASS generate-cli "8 greedy tokens from the run directory on $DEVICE [$((SECONDS - start))s]"
else
  line FAIL generate-cli "$(tail -n 1 "$WORK/generate.log" | cut -c1-200) (log: $WORK/generate.log) [$((SECONDS - start))s]"
fi

if [ "$QUICK" = 1 ]; then
  line SKIP pretrain-2proc "--quick"
elif [ "$DEVICE" = cpu ] || [ "$GPUS" -ge 2 ]; then
  run pretrain-2proc "$WORK/train2" env OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --standalone \
    --nproc-per-node=2 "${TRAIN[@]}" --run-dir "$WORK/train2"
else
  line SKIP pretrain-2proc "one GPU ($GPUS listed by nvidia-smi -L)"
fi

"$PY" scripts/gpu_checks.py --device "$DEVICE" 2>"$WORK/gpu_checks.log" | tee "$WORK/gpu_checks.out"
FAILED=$((FAILED + $(grep -c '^FAIL' "$WORK/gpu_checks.out")))
if [ ! -s "$WORK/gpu_checks.out" ]; then
  line FAIL gpu_checks "printed nothing: $(tail -n 1 "$WORK/gpu_checks.log")"
fi

run rl-debug "$WORK/rl" "$PY" -m lockstep.cli rl --recipe rl-debug --training.device "$DEVICE" --steps "$RL_STEPS" \
  --run-dir "$WORK/rl"
if [ "$QUICK" = 1 ]; then
  line SKIP rl-colocated "--quick"
else  # one process generating with the modules it trains (workers.generators=0)
  run rl-colocated "$WORK/rl0" "$PY" -m lockstep.cli rl --recipe rl-debug --training.device "$DEVICE" \
    --steps "$RL_STEPS" --workers.generators 0 --run-dir "$WORK/rl0"
fi

if [ "$FAILED" = 0 ]; then
  rm -rf "$WORK"
  echo "# all checks passed or skipped"
  exit 0
fi
echo "# $FAILED check(s) failed; logs in $WORK"
exit 1
