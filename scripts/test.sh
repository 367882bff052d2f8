#!/usr/bin/env bash
# Run the test suite in ./.venv (created and filled on first use).
#   bash scripts/test.sh            # the default suite (fast)
#   bash scripts/test.sh -m slow    # the slow tests too; any pytest arguments work
source "$(dirname "$0")/venv.sh" test
# The layering is a contract (pyproject.toml [tool.importlinter]): a crossed layer fails here.
"$(dirname "$PY")/lint-imports" --no-cache >&2 || { echo "lint-imports: a layer of the design is crossed" >&2; exit 1; }
set +e
"$PY" -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$rc"
