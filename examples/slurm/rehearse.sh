#!/usr/bin/env bash
# The restart flow of train.sbatch, rehearsed on one machine with CPU torchrun and gloo,
# using examples/train_tiny.py (or TRAINER=examples/train_megatron_deepspeed.py: a DeepSpeed
# PipelineEngine with Megatron TP; TRAINER=examples/train_megatron_core.py: Megatron-Core with
# its distributed optimizer; any trainer taking the same flags, plus TRAINER_ARGS):
#   1. train at 4 ranks (TP2 x PP2), a checkpoint every 2 steps;
#   2. a node dies: every rank exits hard right after issuing the step-6 save;
#   3. the newest committed checkpoint gets corrupted (one flipped byte);
#   4. restart at 2 ranks (TP1 x PP2: "fewer nodes") through prelaunch.sh;
#   5. it resumes from the previous good checkpoint, and trains on.
# Usage: [TRAINER=examples/X.py] rehearse.sh [WORKDIR]   (RESHARD_MODE=hook|offline as in train.sbatch)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
PY=${PY:-$REPO/.venv/bin/python}
export PYTHON=$PY
export CKPTOOL=${CKPTOOL:-"$PY -m ckptool"}
TRAINER=${TRAINER:-examples/train_tiny.py}
WORK=${1:-$(mktemp -d -t ckptool-rehearse-XXXXXX)}
RUN=$WORK/run
mkdir -p "$WORK"
source "$HERE/prelaunch.sh"

launch() {  # launch NPROC TP PP: the body of the sbatch file, on this machine
  local n=$1 tp=$2 pp=$3; shift 3
  local dp=$((n / (tp * pp)))
  prelaunch "$RUN" "$tp" "$pp" "$dp"
  local load=()
  if [ -n "$LOAD_ROOT" ]; then load=(--load "$LOAD_ROOT"); fi
  "$PY" -m torch.distributed.run --nproc_per_node "$n" --master_addr 127.0.0.1 \
    --master_port "${PORT:-29533}" "$REPO/$TRAINER" ${TRAINER_ARGS:-} --save "$RUN" \
    --tp "$tp" --pp "$pp" "${load[@]}" "$@"
}

echo "== 1-2. train at 4 ranks; all ranks die right after issuing the step-6 save"
set +e
launch 4 2 2 --steps 10 --save-every 2 --crash-after-save 6 --loss-log "$WORK/loss.jsonl" \
  2>"$WORK/crash.err"
rc=$?
set -e
[ "$rc" -ne 0 ] || { echo "expected the job to die" >&2; exit 1; }
newest=$($CKPTOOL latest "$RUN")
echo "after the crash, the newest valid checkpoint is $newest"

echo "== 3. corrupt it"
"$PY" - "$newest" <<'PY'
import pathlib, sys
f = sorted(pathlib.Path(sys.argv[1]).glob("*.distcp"))[0]
b = bytearray(f.read_bytes()); b[len(b) // 2] ^= 0xFF; f.write_bytes(b)
print(f"flipped a byte in {f}")
PY

echo "== 4-5. restart at 2 ranks (TP1 x PP2, RESHARD_MODE=$RESHARD_MODE)"
launch 2 1 2 --steps 10 --save-every 2 --loss-log "$WORK/loss.jsonl" 2>"$WORK/restart.err" \
  | tee "$WORK/restart.log"
good=$(basename "$newest"); good=$((10#${good#step_} - 2))
grep -q "resumed from step $good" "$WORK/restart.log" || {
  echo "expected to resume from step $good" >&2; cat "$WORK/restart.err" >&2; exit 1; }
$CKPTOOL latest "$RUN"
echo "rehearsal passed: resumed from step $good after the crash and the corruption"
