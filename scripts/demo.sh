#!/usr/bin/env bash
# The main job, end to end on CPU: train with checkpoints, inspect, verify, corrupt the
# newest checkpoint, let `ckptool latest` skip it, resume, and check that the resumed
# losses equal the uninterrupted run's.
source "$(dirname "$0")/venv.sh"
RUN=${DEMO_DIR:-demo-run}
rm -rf "$RUN" && mkdir -p "$RUN"
CK="$VENV/bin/ckptool"
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

say "train 30 steps, a committed checkpoint every 10"
"$PY" examples/quickstart.py --root "$RUN/ckpts" --steps 30 --save-every 10 | tee "$RUN/first.log"

say "ckptool inspect $RUN/ckpts   (a run root: its newest checkpoint)"
"$CK" inspect "$RUN/ckpts"

say "ckptool verify --deep"
"$CK" verify "$RUN/ckpts/step_000030" --deep

say "flip one byte in the newest checkpoint's shard"
"$PY" - "$RUN/ckpts/step_000030/__0_0.distcp" <<'PY'
import sys
p = sys.argv[1]; b = bytearray(open(p, "rb").read()); b[len(b) // 2] ^= 1; open(p, "wb").write(b)
PY
set +e
"$CK" verify "$RUN/ckpts/step_000030"; echo "verify exit code: $? (1 = bad checkpoint)"
set -e

say "ckptool latest $RUN/ckpts   (skips the corrupt one)"
"$CK" latest "$RUN/ckpts"

say "resume from the newest valid checkpoint and train to step 30 again"
"$PY" examples/quickstart.py --root "$RUN/resumed" --steps 30 --save-every 100 --resume-from "$RUN/ckpts" \
  | tee "$RUN/resumed.log"

say "losses of steps 21..30: uninterrupted vs resumed"
grep -E '^step +(2[1-9]|30) ' "$RUN/first.log" > "$RUN/a"
grep -E '^step +(2[1-9]|30) ' "$RUN/resumed.log" > "$RUN/b"
paste "$RUN/a" "$RUN/b"
if cmp -s "$RUN/a" "$RUN/b"; then echo "identical: training continued exactly where it stopped"; else echo "MISMATCH" >&2; exit 1; fi
