#!/usr/bin/env bash
# The tests as CI runs them: the whole suite on this CPU as it is, then the `isa` tests (kernels,
# dtypes, int8) again as each CPU kind below this one (LLM_SERVING_MAX_ISA caps our kernels' build,
# oneDNN and every flag check), so one machine runs the paths of the kinds it is not: an AMX Xeon
# also runs Zen 4's and Zen 3's, a Zen 4 Zen 3's, a Zen 3 has none below it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
"$PY" -m pytest -q tests -n 2 --dist loadfile --durations=25
for isa in $("$PY" -m common.cpu --kinds-below); do
  echo "== the isa tests as a CPU capped at $isa: LLM_SERVING_MAX_ISA=$isa"
  LLM_SERVING_MAX_ISA=$isa "$PY" -m pytest -q tests -m isa -n 2 --dist loadfile --durations=10
done
