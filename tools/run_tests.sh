#!/usr/bin/env bash
# make test: the main suite, while beside it the engines' virtualenv is made (if missing),
# the adapters are type-checked against the engines' classes, and then the engine tests
# run (where nothing may skip).  Prints each part's time.
#   usage: tools/run_tests.sh VENV ENGINES_VENV
set -uo pipefail
venv=${1:-.venv} engines=${2:-.venv-engines}
start=$SECONDS
log=$(mktemp) englog=$(mktemp) engtmp=$(mktemp -d)
# The engine tests run beside the main suite, in one worker: they took 110 s after it
# and CI has 20 minutes.  Their own pytest folder: a second pytest session prunes the
# shared /tmp/pytest-of-USER folders of others.
(
  make --no-print-directory ENGINES="$engines" VENV="$venv" engines lint-engines \
    >"$log" 2>&1 || exit 90
  t=$SECONDS
  MXFS_REQUIRE_ENGINES=1 "$engines/bin/python" -m pytest -q -m engines \
    --basetemp "$engtmp" >"$englog" 2>&1
  rc=$?
  echo "test: engine tests took $((SECONDS - t)) s, beside the main suite" >>"$englog"
  exit "$rc"
) &
bg=$!
# Two workers, a test module each at a time (its module-scoped pools stay on one): most
# of a mount test is waiting on daemons and subprocesses, so two share the 2 CPUs well.
"$venv/bin/python" -m pytest -q -m "not engines" -n "${MXFS_TEST_WORKERS:-2}" \
  --dist loadfile --durations=30
main=$?
echo "test: main suite done at $((SECONDS - start)) s"
wait "$bg"
eng=$?
if [ "$eng" -eq 90 ]; then
  tail -n 40 "$log"
  echo "test: making the engines' virtualenv or type-checking the adapters failed" >&2
  exit 1
fi
tail -n 2 "$log"
cat "$englog"
rm -rf "$engtmp"
echo "test: make test took $((SECONDS - start)) s"
[ "$main" -eq 0 ] || exit "$main"
exit "$eng"
