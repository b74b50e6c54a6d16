#!/usr/bin/env bash
# Everything the GPU still has to show, in one call of the device tool (about 9 minutes): the shared
# GPU check's parts, with the test suite on 14 workers instead of the check's serial run (which
# finishes a fifth of the suite in its 300 s), then the memory model against
# torch.cuda.max_memory_allocated, compile=True, and AUTO's picks against the fastest implementation.
#
# From the repository root, with ../shared/gpu copied into .gpu/ as its README says:
#   device run: command "bash benchmarks/gpu_session.sh", carry [".gpu"], timeout_s 600
#   bash benchmarks/gpu_session.sh tests,memory    # some steps only (quick, tests, bench, memory, compile, auto)
#
# Steps run in that order while the deadline allows (DEADLINE seconds, default 570, with each
# step's expected length); what does not fit is named as skipped. Logs come back in $OUT:
# gpu.log and bench.md (the shared check's), pytest-cuda.log (the suite: failures with short
# tracebacks, the 30 slowest tests), bench_cuda.md (every part of benchmarks/bench_cuda.py) and
# session.log (this script's lines).
set -uo pipefail
cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
steps=${1:-quick,tests,bench,memory,compile,auto}
deadline=${DEADLINE:-570}
out=${OUT:-/tmp/gpu-out}; mkdir -p "$out"; export OUT="$out" PYTHONUNBUFFERED=1
exec > >(tee -a "$out/session.log") 2>&1
[ -f .gpu/check ] || { echo "no .gpu/check: copy ../shared/gpu into .gpu/ and carry it"; exit 2; }
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || python3 -m pip install -q --no-deps -e . || exit 2
rc=0
step() {  # step NAME EXPECTED_SECONDS LIMIT_SECONDS COMMAND...: runs it if EXPECTED still fits before the deadline
  local name=$1 expected=$2 limit=$3; shift 3
  case ",$steps," in *",$name,"*) ;; *) return 0 ;; esac
  local left=$((deadline - SECONDS))
  if [ "$left" -lt "$expected" ]; then echo "== $name: skipped, $left s left of the deadline (needs about $expected s)"; return 0; fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS
  timeout -s INT -k 15 "$limit" "$@"
  local r=$?
  echo "== $name: exit $r in $((SECONDS - t0)) s (limit $limit)"
  [ $r -eq 0 ] || rc=1
}
xdist=""
python3 -c "import xdist" 2>/dev/null && xdist="-n 14"
step quick 30 90 bash .gpu/check quick
# SIGINT at the limit: pytest still prints its summary. Docs tests need sphinx, which the GPU image lacks.
step tests 120 220 bash -c "python3 -m pytest tests -q -p no:cacheprovider --device cuda $xdist \
  --deselect tests/test_docs.py -W ignore::DeprecationWarning --tb=short -rfE --durations=30 \
  > '$out/pytest-cuda.log' 2>&1; r=\$?; tail -n 60 '$out/pytest-cuda.log'; exit \$r"
step bench 200 380 bash .gpu/check bench
step memory 90 200 python3 benchmarks/bench_cuda.py --device cuda --parts memory
step compile 90 200 python3 benchmarks/bench_cuda.py --device cuda --parts compile
step auto 60 120 python3 benchmarks/bench_cuda.py --device cuda --parts auto
echo "gpu session: exit $rc after $SECONDS s"
exit $rc
