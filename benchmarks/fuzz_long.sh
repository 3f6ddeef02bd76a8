#!/usr/bin/env bash
# The long fuzz run: the four tests of tests/test_fuzz.py with FUZZ_EXAMPLES cases each
# (default 2500: 10,000 cases in all), random (not derandomized) inputs. Prints pytest's summary;
# any failing case is printed by hypothesis with the input that broke the promise.
set -euo pipefail
cd "$(dirname "$0")/.."
FUZZ_EXAMPLES="${FUZZ_EXAMPLES:-2500}" python -m pytest -q -p no:cacheprovider tests/test_fuzz.py \
  --hypothesis-show-statistics "$@"
