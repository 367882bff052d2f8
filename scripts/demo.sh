#!/usr/bin/env bash
# The main job, end to end on CPU: train a tiny Llama-style model with real TP x PP over
# gloo (4 processes under torchrun), with asynchronous checkpoints; inspect and verify;
# corrupt the newest checkpoint and let `ckptool latest` skip it; resume on another
# topology (TP1 x PP2 x DP2) and check the loss curve continues; reshard offline; convert
# to Hugging Face and check that transformers gives the trainer's logits.
source "$(dirname "$0")/venv.sh" demo
RUN=${DEMO_DIR:-demo-run}
rm -rf "$RUN" && mkdir -p "$RUN"
CK="$VENV/bin/ckptool"
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
train() {  # train NPROC ARGS...: examples/train_tiny.py under torchrun on this machine
  local n=$1; shift
  "$PY" -m torch.distributed.run --nproc_per_node "$n" --master_addr 127.0.0.1 \
    --master_port "${DEMO_PORT:-29517}" examples/train_tiny.py --save "$RUN/ckpts" "$@" 2>"$RUN/torchrun.err" \
    || { cat "$RUN/torchrun.err" >&2; exit 1; }
}

say "train at TP2 x PP2 (4 processes), an async checkpoint every 4 steps"
train 4 --tp 2 --pp 2 --steps 12 --save-every 4 --loss-log "$RUN/first.jsonl"

say "ckptool inspect $RUN/ckpts   (a run root: its newest checkpoint)"
"$CK" inspect "$RUN/ckpts" --top 4

say "ckptool verify --deep"
"$CK" verify "$RUN/ckpts/step_00000012" --deep

say "flip one byte in the newest checkpoint"
"$PY" - "$RUN/ckpts/step_00000012/__3_0.distcp" <<'PY'
import sys
p = sys.argv[1]; b = bytearray(open(p, "rb").read()); b[len(b) // 2] ^= 1; open(p, "wb").write(b)
PY
set +e
"$CK" verify "$RUN/ckpts/step_00000012"; echo "verify exit code: $? (1 = bad checkpoint)"
set -e

say "ckptool latest $RUN/ckpts   (skips the corrupt one)"
"$CK" latest "$RUN/ckpts"

say "resume on another topology, TP1 x PP2 x DP2: the hook reshards at load time"
train 4 --tp 1 --pp 2 --dp 2 --steps 16 --save-every 4 --loss-log "$RUN/resumed.jsonl"

say "losses of steps 9..12: TP2xPP2 before the restart vs TP1xPP2xDP2 after it"
"$PY" - "$RUN/first.jsonl" "$RUN/resumed.jsonl" <<'PY'
import json, sys
first, resumed = ({d["step"]: d["loss"] for d in map(json.loads, open(p))} for p in sys.argv[1:])
worst = 0.0
for step in range(9, 13):
    rel = abs(first[step] - resumed[step]) / abs(first[step])
    worst = max(worst, rel)
    print(f"step {step:3d}  {first[step]:.6f}  {resumed[step]:.6f}  rel. diff {rel:.1e}")
if worst > 1e-5:
    sys.exit("MISMATCH: the resumed run does not continue the loss curve")
print("the loss curve continues across the topology change")
PY

say "offline: ckptool reshard the newest checkpoint for 1 process, and to Megatron TP2"
"$CK" reshard "$RUN/ckpts/step_00000016" "$RUN/step16-world1" --to-tp 1 --to-pp 1 --to-dp 1
"$CK" verify "$RUN/step16-world1"
"$CK" convert "$RUN/ckpts/step_00000016" "$RUN/megatron-tp2" --to megatron --tp 2 --pp 1 --drop-optimizer

say "convert to Hugging Face; transformers must give the trainer's logits"
"$CK" convert "$RUN/ckpts/step_00000016" "$RUN/hf" --to hf
train 2 --tp 2 --pp 1 --eval-logits "$RUN/trainer-logits.pt"
"$PY" - "$RUN/hf" "$RUN/trainer-logits.pt" <<'PY'
import sys, torch, transformers
transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()
model, info = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], output_loading_info=True)
assert not info["missing_keys"] and not info["unexpected_keys"], info
ref = torch.load(sys.argv[2])
with torch.no_grad():
    logits = model(ref["tokens"]).logits
vocab = model.config.vocab_size
diff = (logits - ref["logits"][..., :vocab]).abs().max().item()
print(f"{type(model).__name__}: vocab {vocab}, step {ref['step']}, max |logit diff| vs the trainer = {diff:.1e}")
if diff > 1e-5:
    sys.exit("MISMATCH")
PY
say "done: $RUN"
