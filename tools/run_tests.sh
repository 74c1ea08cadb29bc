#!/usr/bin/env bash
# make test: the main suite, while the engines' virtualenv is made (if missing) and the
# adapters are type-checked against the engines' classes in the background; then the
# engine tests, where nothing may skip.  Prints each part's time.
#   usage: tools/run_tests.sh VENV ENGINES_VENV
set -uo pipefail
venv=${1:-.venv} engines=${2:-.venv-engines}
start=$SECONDS
log=$(mktemp)
( make --no-print-directory ENGINES="$engines" VENV="$venv" engines lint-engines >"$log" 2>&1 ) &
bg=$!
# Two workers, a test module each at a time (its module-scoped pools stay on one): most
# of a mount test is waiting on daemons and subprocesses, so two share the 2 CPUs well.
"$venv/bin/python" -m pytest -q -m "not engines" -n "${MXFS_TEST_WORKERS:-2}" \
  --dist loadfile --durations=30
main=$?
echo "test: main suite done at $((SECONDS - start)) s"
wait "$bg"
eng=$?
if [ "$eng" -ne 0 ]; then
  tail -n 40 "$log"
  echo "test: making the engines' virtualenv or type-checking the adapters failed" >&2
  exit 1
fi
tail -n 2 "$log"
[ "$main" -eq 0 ] || exit "$main"
t=$SECONDS
# (two workers too: vLLM's generation is half of it, the adapters' modules the rest)
MXFS_REQUIRE_ENGINES=1 "$engines/bin/python" -m pytest -q -m engines -n 2 --dist loadfile
rc=$?
echo "test: engine tests took $((SECONDS - t)) s; make test took $((SECONDS - start)) s"
exit "$rc"
