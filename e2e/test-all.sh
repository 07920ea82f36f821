#!/usr/bin/env bash
# `make test`: the unit tests (tests/) and the cluster tests (e2e/) side by side.
#
# The e2e tests spend most of their time waiting: on pods, on the autotuner's windows, on
# Prometheus. The unit tests fill that time: they run beside them under `nice` (the cluster,
# its pods and the e2e driver come first), on $JOBS xdist workers, with their output kept in
# a file and printed once both are done. Each part prints its 20 slowest tests; the last line
# is the whole run's time. Exit status: non-zero when either part failed.
set -u
cd "$(dirname "$0")/.."
JOBS=${JOBS:-2}
PYTEST=${PYTEST:-.venv/bin/pytest}
start=$(date +%s)
out=$(mktemp -d "${TMPDIR:-/tmp}/kvpilot-test.XXXXXX")
trap 'rm -rf "$out"' EXIT

# KEDA's test runs in make autotune-bench (its first build alone takes ~11 min): -m "not keda"
E2E=(-m "not keda" e2e)

# The cluster's parts and kvpilot's images first, with the machine to themselves: collecting
# the e2e tests builds what is missing (conftest), and the run below finds it done. After a
# code change the images are rebuilt: their archive took 122 s with the unit tests beside it,
# 85 s alone. Progress shows; the collected tests' names do not.
"$PYTEST" -q --collect-only "${E2E[@]}" 2>&1 | grep -v -e '::' -e 'tests* collected' -e '^$'
build_rc=${PIPESTATUS[0]}

nice -n 10 "$PYTEST" -q -n "$JOBS" --dist loadfile --durations=20 tests > "$out/unit.log" 2>&1 &
unit=$!
# Ctrl-C or a kill stops both parts.
trap 'kill -INT $unit 2>/dev/null; wait $unit 2>/dev/null; rm -rf "$out"; exit 130' INT TERM

echo "unit tests (tests/): running beside the e2e tests; their output follows the e2e tests'"
if [ "$build_rc" -eq 0 ]; then
    "$PYTEST" -q --durations=20 "${E2E[@]}"
    e2e_rc=$?
else
    echo "e2e tests not run: the local cluster's parts could not be built (above)"
    e2e_rc=$build_rc
fi
e2e_s=$(( $(date +%s) - start ))
wait $unit
unit_rc=$?
echo
echo "================ unit tests (tests/), run beside the e2e tests ================"
cat "$out/unit.log"
echo "make test: $(( $(date +%s) - start )) s in all; e2e ${e2e_s} s (exit $e2e_rc); unit tests exit $unit_rc"
[ "$e2e_rc" -eq 0 ] && [ "$unit_rc" -eq 0 ]
