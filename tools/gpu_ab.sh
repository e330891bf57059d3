#!/usr/bin/env bash
# tools/gpu_ab.sh: builds of fast._cuda against each other, by turns, in one device call (issue 19's
# method: docs/perf.md). Each build is a module built elsewhere for the device's Python and carried in
# as .variants/NAME.so or .variants/NAME.so.xz (xz: three builds fit a run's 64 MiB carry, each stripped first,
# `strip --strip-unneeded`, which keeps the device code and the module's entry: ~18.2 MB a build); fast/_core
# must import (carried in, or built). Per round, per build: tools/bench_throughput.py --no-peer in its
# own process (two untimed passes of each shape, the median of 5 timed ones), one line of tok/s each.
#
#   bash tools/gpu_ab.sh                          # every build in .variants, 2 rounds, b32 b128 + prefill 2048
#   BUILDS="base new" ROUNDS=3 BATCHES=1,32 PREFILL="" bash tools/gpu_ab.sh
#   TEST_BUILD=new bash tools/gpu_ab.sh           # then the GPU tests (and the slice test) with that build
#   PROFILE="32 128 p2048" bash tools/gpu_ab.sh   # then a kernel profile (PDL off) of each build at these batches
#                                                 # (pN: a prefill of N tokens; PROFILE_ROWS kernels listed, 12)
#   BUILDS="new new+GLM_PAIRS=0" bash tools/gpu_ab.sh  # one build with and without an engine option (NAME+VAR=VAL[+...]:
#                                                 # the build NAME, its processes run with those variables; fast/cuda.py's GLM_*)
#
# Logs go to LOGS (default /tmp/gpu_ab_logs) and are packed at the end into OUT/gpu_ab_logs.tgz (OUT default
# /tmp/gpu_ab; the device machine returns one file, not a dozen past its count limit), and the summary
# lines (tests, rounds) are printed again last, so that the tail of the output holds them.
# Environment: OUT, LOGS, RELEASE (fp8: the slice release the rounds and profiles run, fp8 or mxfp4),
# GLM_SLICE_DIR (default /tmp/slice: slice-RELEASE is made there
# when absent, in the background, as gpu_check makes it, with its SLICE_LAYERS and SLICE_EXPERTS), BUILDS (default: every .variants/NAME.so[.xz],
# sorted), ROUNDS (2), BATCHES (32,128), PREFILL (2048; "" for none), TEST_BUILD, PROFILE.
# The build under test is copied over fast/_cuda*.so (what was there is put back at the end).
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }
OUT=${OUT:-/tmp/gpu_ab}
LOGS=${LOGS:-/tmp/gpu_ab_logs}
SLICE=${GLM_SLICE_DIR:-/tmp/slice}
mkdir -p "$OUT" "$LOGS"
SUMMARY="$LOGS/summary.txt"
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
TARGET=$(python3 -c "import sysconfig; print('fast/_cuda' + sysconfig.get_config_var('EXT_SUFFIX'))")
[ -f "$TARGET" ] && cp "$TARGET" "$LOGS/_cuda.saved"
finish() {
  [ -f "$LOGS/_cuda.saved" ] && cp "$LOGS/_cuda.saved" "$TARGET"
  echo "== summary"; cat "$SUMMARY"
  tar czf "$OUT/gpu_ab_logs.tgz" -C "$LOGS" --exclude _cuda.saved . 2>/dev/null
}
trap finish EXIT

src_of() {  # the carried file of build $1
  if [ -f ".variants/$1.so.xz" ]; then echo ".variants/$1.so.xz"; elif [ -f ".variants/$1.so" ]; then echo ".variants/$1.so"; fi
}
use() {  # put build $1 in place as fast._cuda (an entry NAME+VAR=VAL...: the build NAME)
  local n="${1%%+*}" f; f=$(src_of "$n")
  [ -n "$f" ] || { echo "no .variants/$n.so or .variants/$n.so.xz"; exit 2; }
  case "$f" in *.xz) xz -dc "$f" > "$TARGET" ;; *) cp "$f" "$TARGET" ;; esac
}
settings_of() {  # the variables of entry $1 (NAME+VAR=VAL+...), space-separated; none for a plain NAME
  case "$1" in *+*) echo "${1#*+}" | tr '+' ' ' ;; esac
}
tag_of() { echo "${1//[^A-Za-z0-9_.-]/_}"; }  # entry $1 as a file name
if [ -z "${BUILDS:-}" ]; then
  BUILDS=$(ls .variants 2>/dev/null | sed -nE 's/^(.*)\.so(\.xz)?$/\1/p' | sort -u | tr '\n' ' ')
fi
[ -n "$BUILDS" ] || { echo "no builds: carry .variants/NAME.so or .variants/NAME.so.xz"; exit 2; }
echo "builds: $BUILDS; rounds ${ROUNDS:-2}; batches ${BATCHES:-32,128}; prefill ${PREFILL-2048}; $(nvidia-smi -L | head -1)"

MAKE_PID=""
REL=${RELEASE:-fp8}
if [ ! -f "$SLICE/slice-$REL/config.json" ]; then
  ( NUMBA_NUM_THREADS=2 OMP_NUM_THREADS=2 python3 tools/bench_cuda.py --slice-dir "$SLICE" --make-only --layers "${SLICE_LAYERS:-2}" --experts "${SLICE_EXPERTS:-288}" \
      --releases "$REL" --workers $(( $(nproc) / 4 + 1 )) > "$LOGS/slice_make.log" 2>&1 ) &
  MAKE_PID=$!
fi
if [ -n "${TEST_BUILD:-}" ]; then  # (while the slice is made: the tests do not read it)
  use "$TEST_BUILD"
  timeout 300 python3 -m pytest tests/test_fast_cuda.py tests/test_head_bound.py tests/test_mla_softmax.py -m gpu -q -p no:cacheprovider \
    -k "not slice and not exhaustive" > "$LOGS/pytest.log" 2>&1
  say "GPU tests ($TEST_BUILD): exit $? at $(elapsed) s: $(tail -1 "$LOGS/pytest.log")"
  grep -E "^(FAILED|ERROR)" "$LOGS/pytest.log" | head -20 | tee -a "$SUMMARY"
fi
[ -n "$MAKE_PID" ] && { wait "$MAKE_PID"; tail -1 "$LOGS/slice_make.log"; }
if [ -n "${TEST_BUILD:-}" ]; then
  use "$TEST_BUILD"
  GLM_SLICE_DIR="$SLICE" timeout 200 python3 -m pytest tests/test_fast_cuda.py -q -p no:cacheprovider -k slice > "$LOGS/pytest_slice.log" 2>&1
  say "slice test ($TEST_BUILD): exit $? at $(elapsed) s: $(tail -1 "$LOGS/pytest_slice.log")"
fi

for round in $(seq 1 "${ROUNDS:-2}"); do
  for b in $BUILDS; do
    use "$b"
    log="$LOGS/ab_$(tag_of "$b")_$round.log"
    env $(settings_of "$b") python3 tools/bench_throughput.py --checkpoint "$SLICE/slice-$REL" --no-peer --batches "${BATCHES:-32,128}" \
      --prefill "${PREFILL-2048}" > "$log" 2>&1
    say "round $round $b (at $(elapsed) s): $(grep -E 'engine (decode|prefill)' "$log" \
      | sed -E 's/.*engine (decode|prefill) ([^:]*):.* ([0-9.]+) tok\/s/\2 \3/' | tr '\n' ' ')"
  done
done

for b in ${PROFILE:+$BUILDS}; do
  use "$b"
  for B in $PROFILE; do
    plog="$LOGS/profile_$(tag_of "$b")_b$B.log"
    case "$B" in  # pN: a prefill of N tokens (2 of them), else a decode batch (3 steps)
      p*) shape=(--prefill "${B#p}" --steps 2) ;;
      *) shape=(--batch "$B" --steps 3) ;;
    esac
    env $(settings_of "$b") GLM_PDL=0 timeout 120 python3 tools/profile_cuda.py --checkpoint "$SLICE/slice-$REL" "${shape[@]}" \
      > "$plog" 2>&1
    echo "== profile $b $B (PDL off)"; grep -E "wall per step|device busy" "$plog"
    grep -E "^  k_|^  Memcpy" "$plog" | head -${PROFILE_ROWS:-12}
  done
done
echo "done at $(elapsed) s"
