# Sourced by the other scripts: make ./.venv with ckptool and the given extras installed.
# torch is pinned first so pip never swaps in a several-GB CUDA build; in an NGC container,
# use your own environment and `pip install -e .` instead (pyproject asks only torch>=2.4).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${CKPTOOL_VENV:-.venv}
EXTRAS=${1:-}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
stamp="$VENV/.ckptool-installed${EXTRAS:+-$EXTRAS}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  "$PY" -m pip install -q --disable-pip-version-check torch==2.13.0
  "$PY" -m pip install -q --disable-pip-version-check -e ".${EXTRAS:+[$EXTRAS]}"
  if [ "$EXTRAS" = test ]; then
    # DeepSpeed builds against the installed torch: no build isolation (which would fetch a
    # CUDA torch), no compiled ops (DS_ACCELERATOR=cpu at run time).
    DS_BUILD_OPS=0 "$PY" -m pip install -q --disable-pip-version-check --no-build-isolation "deepspeed>=0.16"
  fi
  touch "$stamp"
fi
