#!/usr/bin/env bash
# Run the test suite in ./.venv (created and filled on first use).
#   bash scripts/test.sh            # the default suite (fast)
#   bash scripts/test.sh -m slow    # the slow tests too; any pytest arguments work
source "$(dirname "$0")/venv.sh" test
set +e
"$PY" -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$rc"
