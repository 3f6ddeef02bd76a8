#!/usr/bin/env bash
# The long fuzz run: the four tests of tests/test_fuzz.py (twin command line, backend command line,
# spec files of every kind, system files through `twin simulate --json`) with FUZZ_EXAMPLES random
# (not derandomized) cases each: default 2500, 10,000 cases in all. About 20 minutes on 2 cores.
# Prints hypothesis' statistics per test (cases passed, failed, invalid) and a last line with the case
# count, the wall time and the result; any failing case is printed by hypothesis with the input that
# broke the promise (exit 0, or one line and exit 2; no traceback, no hang). Then benchmarks/bad_inputs.py
# runs the issue's hand-written cases as real processes (a few minutes; FUZZ_SUBPROCESS=0 skips it).
# The last recorded run: benchmarks/fuzz_long.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
n="${FUZZ_EXAMPLES:-2500}"
start=$(date +%s)
FUZZ_EXAMPLES="$n" python -m pytest -q -p no:cacheprovider tests/test_fuzz.py --hypothesis-show-statistics "$@"
rc=$?
echo "fuzz_long: $((4 * n)) cases (4 tests x $n), $(( $(date +%s) - start )) s wall, $([ $rc = 0 ] && echo passed || echo "FAILED (exit $rc)")"
# The fuzz drives the commands in process (typer's runner); a sample through real processes (exit code,
# stderr, timeouts): the hand-written cases of issue 12, each `python -m twin.cli/backend.cli.main` in its own process.
if [ "${FUZZ_SUBPROCESS:-1}" = 1 ]; then
  python benchmarks/bad_inputs.py || rc=$?
fi
exit $rc
