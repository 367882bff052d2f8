# Sourced by train.sbatch and rehearse.sh: decide what a (re)started job loads.
#
#   prelaunch RUN_ROOT TP PP DP      -> sets LOAD_ROOT (empty: start fresh) or exits
#
# * Nothing saved yet under RUN_ROOT: start fresh.
# * Checkpoints exist but none verifies: exit 3 with the reasons (never silently restart
#   from scratch on top of a broken run).
# * The newest valid checkpoint was written by another topology (fewer or more nodes):
#   RESHARD_MODE=hook (default) lets the training hook reshard at load time;
#   RESHARD_MODE=offline runs `ckptool reshard` first into
#   RUN_ROOT.resharded/tpT_ppP_dpD-NAME/NAME and loads from there (for trainers whose loader
#   cannot reshard, e.g. Megatron's legacy one).
CKPTOOL=${CKPTOOL:-ckptool}
RESHARD_MODE=${RESHARD_MODE:-hook}

prelaunch() {
  local root=$1 tp=$2 pp=$3 dp=$4 ckpt saved
  LOAD_ROOT=""
  # a save killed before it committed leaves only STEP.tmp-*: nothing saved, not a broken run
  # (-print -quit, not | head -1: under pipefail, find's SIGPIPE ended the script at ~200 saves)
  saved=$(find "$root" -mindepth 1 -maxdepth 1 \( -name 'step_*' -o -name 'iter_*' -o -name 'global_step*' \) \
          ! -name '*.tmp-*' -print -quit 2>/dev/null)
  if [ -z "$saved" ]; then
    echo "prelaunch: nothing saved under $root yet: starting fresh"
    return 0
  fi
  if ! ckpt=$($CKPTOOL latest "$root"); then
    echo "prelaunch: checkpoints exist under $root but none is valid (see above); not starting" >&2
    echo "prelaunch: inspect with '$CKPTOOL verify --deep', or move $root away to start fresh" >&2
    exit 3
  fi
  local was
  was=$($CKPTOOL inspect "$ckpt" --json | "${PYTHON:-python3}" -c \
        'import json,sys; t=json.load(sys.stdin)["topology"] or {}; print(t.get("tp",1), t.get("pp",1), t.get("dp",1))')
  read -r old_tp old_pp old_dp <<<"$was"
  echo "prelaunch: resuming from $ckpt (saved at TP$old_tp x PP$old_pp x DP$old_dp; now TP$tp x PP$pp x DP$dp)"
  LOAD_ROOT=$root
  if [ "$old_tp $old_pp $old_dp" = "$tp $pp $dp" ]; then
    return 0
  fi
  case "$RESHARD_MODE" in
    hook)
      echo "prelaunch: topology changed: the training hook reshards at load time" ;;
    offline)
      # one directory per target topology and checkpoint, holding that reshard alone: one made
      # for another job size, or a newer step the run has since gone back from, is never loaded
      local into="$root.resharded/tp${tp}_pp${pp}_dp${dp}-$(basename "$ckpt")"
      local out="$into/$(basename "$ckpt")"
      if [ ! -e "$out" ]; then
        $CKPTOOL reshard "$ckpt" "$out" --to-tp "$tp" --to-pp "$pp" --to-dp "$dp"
      fi
      $CKPTOOL verify "$out" >/dev/null
      LOAD_ROOT="$into"
      # a Megatron or DeepSpeed root (latest printed the root: its tracker names the step) is
      # loaded as the root its reshard is
      if [ "$ckpt" = "$root" ] || [ "$(cd "$ckpt" && pwd -P)" = "$(cd "$root" && pwd -P)" ]; then
        LOAD_ROOT="$out"
      fi ;;
    *)
      echo "prelaunch: RESHARD_MODE must be hook or offline, not '$RESHARD_MODE'" >&2; exit 2 ;;
  esac
}
