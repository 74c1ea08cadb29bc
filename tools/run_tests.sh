#!/usr/bin/env bash
# make test: the main suite in two workers while, in the background, the engines'
# virtualenv is made (if missing), the adapters are type-checked against the engines'
# classes, and the engine tests run (one worker: nothing may skip there).  Most of a
# mount test is waiting on daemons and subprocesses, so the engines' part fits in the
# main suite's time instead of after it.  Prints each part's time.
#   usage: tools/run_tests.sh VENV ENGINES_VENV
set -uo pipefail
venv=${1:-.venv} engines=${2:-.venv-engines}
start=$SECONDS
log=$(mktemp)
# The suite starts some thousands of Python processes (daemons, the CLI, users' scripts):
# each compiled every module of mxfs again where PYTHONDONTWRITEBYTECODE is set (a third
# of the CPU of a mount test).  Compiled once here, and written again by the first
# process that imports a module edited since.
unset PYTHONDONTWRITEBYTECODE
"$venv/bin/python" -m compileall -q mxfs tools >/dev/null
# Two workers, the engines beside them and the daemons they start share the CPUs: torch's
# OpenMP threads, one a CPU in every process, spin waiting for each other and take CPU
# the others need (the whole run is CPU-bound).  One each.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
(
  set -e
  make --no-print-directory ENGINES="$engines" VENV="$venv" engines lint-engines
  echo "test: engines' virtualenv ready and adapters checked at $((SECONDS - start)) s"
  t=$SECONDS
  MXFS_REQUIRE_ENGINES=1 "$engines/bin/python" -m pytest -q -m engines -p no:cacheprovider
  echo "test: engine tests took $((SECONDS - t)) s"
) >"$log" 2>&1 &
bg=$!
# Two workers, a test module each at a time (its module-scoped pools stay on one).
"$venv/bin/python" -m pytest -q -m "not engines" -n "${MXFS_TEST_WORKERS:-2}" \
  --dist loadfile --durations=30
main=$?
echo "test: main suite done at $((SECONDS - start)) s"
wait "$bg"
eng=$?
if [ "$eng" -ne 0 ]; then
  tail -n 60 "$log"
  echo "test: the engines' part failed (making their virtualenv, type-checking the" \
       "adapters, or the engine tests)" >&2
else
  grep -E "^test: |passed|failed" "$log" | tail -n 4
fi
echo "test: make test took $((SECONDS - start)) s"
[ "$main" -eq 0 ] || exit "$main"
exit "$eng"
