#!/usr/bin/env bash
# Run one pytest selection N times in a row and report every round and each failing test.
# For tests whose failure depends on timing (preemption, fault tolerance), one green run says
# little: docs/testing.md records this loop's figure.
#
#   scripts/repeat_tests.sh N [-- PYTEST_ARGS...]
#   scripts/repeat_tests.sh 10                      # the preemption and fault-tolerance tests below
#   scripts/repeat_tests.sh 3 -- tests/test_fault_tolerance.py -k sigterm -n 2
#
# Environment: PYTHON (default: python), REPEAT_LOG_DIR (each round's whole output; default: a
# new temporary folder). Exit status: 0 when every round passed, 1 otherwise, 2 on bad usage.
set -uo pipefail

# Every test that stops a run by a signal or a fault and checks how it ends and resumes.
DEFAULT_TESTS=(
    tests/test_fault_tolerance.py
    tests/test_slurm.py::test_signal_checkpoints_requeues_and_resumes_the_identical_run
    tests/test_ray.py::test_sigterm_to_the_driver_saves_the_step_reached_and_a_new_driver_resumes
    tests/test_launchers.py::test_max_restarts_resumes_from_the_last_checkpoint_after_a_rank_is_killed
    tests/test_preloaded.py
)

if [ $# -lt 1 ] || ! [[ "$1" =~ ^[1-9][0-9]*$ ]] || { [ $# -gt 1 ] && [ "$2" != "--" ]; }; then
    echo "usage: $0 N [-- PYTEST_ARGS...]   (N: rounds, a positive integer)" >&2
    exit 2
fi
rounds=$1
shift $(( $# > 1 ? 2 : 1 ))
[ $# -gt 0 ] || set -- "${DEFAULT_TESTS[@]}"
PYTHON="${PYTHON:-python}"
logs="${REPEAT_LOG_DIR:-$(mktemp -d -t repeat-tests-XXXXXX)}"
mkdir -p "$logs"

echo "repeat_tests: $rounds rounds of: pytest $*"
echo "repeat_tests: $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), logs in $logs"
start=$(date +%s)
failed_rounds=0
: > "$logs/failures.txt"
for round in $(seq 1 "$rounds"); do
    log="$logs/round-$round.log"
    round_start=$(date +%s)
    "$PYTHON" -m pytest -p no:cacheprovider "$@" > "$log" 2>&1
    status=$?
    # pytest's last line: "==== 3 passed in 9.1s ====" by default, "3 passed in 9.1s" under -q.
    summary=$(grep -E '^(=+ )?([0-9]+ [a-z]+|no tests ran)[^=]* in [0-9.]+s( \([0-9:]+\))?( =+)?$' "$log" \
        | tail -n 1 | tr -d '=' | sed 's/^ *//;s/ *$//')
    echo "round $round/$rounds: exit $status, $(( $(date +%s) - round_start )) s, load $(cut -d' ' -f1-3 /proc/loadavg): ${summary:-no pytest summary (see $log)}"
    if [ "$status" -ne 0 ]; then
        failed_rounds=$((failed_rounds + 1))
        grep -E '^(FAILED|ERROR) ' "$log" | sed "s/^/  round $round: /" | tee -a "$logs/failures.txt"
        grep -qE '^(FAILED|ERROR) ' "$log" || echo "  round $round: EXIT $status (no failing test named: see $log)" \
            | tee -a "$logs/failures.txt"
    fi
done
echo "repeat_tests: $((rounds - failed_rounds))/$rounds rounds passed in $(( $(date +%s) - start )) s, load now $(cut -d' ' -f1-3 /proc/loadavg)"
if [ "$failed_rounds" -gt 0 ]; then
    echo "repeat_tests: failures by test:"
    sed -E 's/^ *round [0-9]+: (FAILED|ERROR|EXIT) ([^ ]+).*/\1 \2/' "$logs/failures.txt" | sort | uniq -c | sort -rn
    exit 1
fi
