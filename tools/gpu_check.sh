#!/usr/bin/env bash
# tools/gpu_check.sh: on a GPU machine, build the CUDA engine, run its tests and the benchmarks, and
# print everything (also into $OUT/gpu_check.log). Run from anywhere; it works in the repository root.
#
#   bash tools/gpu_check.sh
#
# Environment: OUT (logs and results, default /tmp/gpu_check), GLM_SLICE_DIR (slice checkpoints, default
# /tmp/slice; made here with tools.zoo when absent), BUDGET (seconds for the whole run, default 450),
# SLICE_LAYERS (2), SLICE_EXPERTS (288), SKIP_PEER=1 (no transformers peer), RELEASES (fp8,mxfp4),
# TESTS=0 (skip the GPU tests: a performance iteration) or quick (skip the exhaustive expf and the slowest), LINEAR_TESTS=0 (not the linear kernels' test), SLICE_TESTS=0 (not the slice phase),
# TESTS_K (a pytest -k expression instead), PROFILE=1 (kernel timeline of decode steps, tools/profile_cuda.py,
# after the benchmarks; PROFILE_ENV=GLM_PDL=0 times each kernel alone, since with programmatic launch a
# kernel's time includes its wait for the previous one), LINEAR_BENCH=1 (tools/bench_linear.py at the end; LINEAR_ONLY, LINEAR_VARIANTS narrow it),
# NCU=1 (ncu counters and warp stall reasons of the routed-expert kernels; NCU_ONLY, NCU_VARIANTS, NCU_COUNT for others),
# NCU_KERNELS=REGEX (ncu --set full on the engine's kernels whose names match, in decode steps at batch 1:
# details and per-SASS-instruction stall samples into $OUT; NCU_SKIP, NCU_KCOUNT: which launches), NCU_GEMM=SHAPE (ncu of the
# register-tiled kernel, or NCU_GEMM_KERNELS="gemm pairs lanes" each, on a tools/bench_gemm.py shape at NCU_GEMM_T tokens, read by tools/ncu_blocks.py), BENCH=0 (no benchmarks),
# SASS=REGEX (cuobjdump of the kernels whose mangled names match, with each one's instruction mix), PREBUILT=1 (use fast/_core and fast/_cuda carried in),
# FLASH=1 (make the flash zoo checkpoint instead of the slice, then tools/bench_flash.py: full-depth decode b1 and
# CUDA = CPU at 45 layers; with BENCH=0 since there is no slice), CONTEXT=1024,...,131072 (tools/bench_context.py on slice-fp8 after the benchmarks: decode b1 and prefill as the context grows; CONTEXT_AB="VAR=VALUE ...": again with each setting),
# AB="VAR=VALUE ..." (decode again with each setting, e.g. GLM_PDL=0 GLM_EXPERT_TILE=4), EP=0 (no expert-parallel
# tests and benchmark where the host has 2+ GPUs; EP_RANKS: ranks of its benchmark, default every GPU). Builds of fast._cuda carried in .variants/NAME.so are benchmarked
# after the main build (VARIANT_PREFILL=0: decode only). SERVE=1 (after the slice test: the serving acceptance of
# issues 20 and 21, docs/serve.md "GPU acceptance": the server tests with the server on the CUDA engine, the replay
# gate on slice-fp8, serve c16 / offline b16 on small-fp8 (CPU, made into SMALL_DIR, default /tmp/zoo-small) and
# slice-fp8 (CUDA), speculation timed and TTFT on a cached 4K prefix on slice-fp8; SERVE_STEPS: which of these five,
# default abcde; SERVE_CPU_THREADS: the CPU engine's threads; SERVE_AB="VAR=VAL ...": step c's CUDA figure again with each).
# THROUGHPUT=1 (tools/bench_throughput.py per release: engine and warmed peer at b1..b256 and prefill 512..16384
# against the step roofline; THROUGHPUT_ARGS passed on).
# Wheels in .whl/ (e.g. transformers 5.23 for the peer) are installed into /tmp/site first.
#
# Order, most important first: machine facts; build (fast._core + fast._cuda, GLM_FORCE_CUDA=ON);
# the GPU tests (tests/test_fast_cuda.py, while the slice checkpoints are generated in the background);
# the benchmarks (tools/bench_cuda.py); the slice test (CUDA vs CPU engine at real widths).
set -u -o pipefail
START=$(date +%s)
BUDGET=${BUDGET:-450}
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
exec > >(tee -a "$LOG") 2>&1
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
ROOT=$(pwd)
SLICE=${GLM_SLICE_DIR:-/tmp/slice}
LAYERS=${SLICE_LAYERS:-2}
EXPERTS=${SLICE_EXPERTS:-288}
RELEASES=${RELEASES:-fp8,mxfp4}
elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( BUDGET - $(elapsed) )); }
phase() { echo; echo "=== [$(elapsed) s] $*"; }

phase "machine"
nvidia-smi -L
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader
echo "cores: $(nproc); $(python3 -V); $(nvcc --version | tail -1); cmake $(cmake --version | head -1 | cut -d' ' -f3)"
df -h /tmp | tail -1

if [ "${CPU_ONLY:-0}" = "1" ]; then
  # CPU_ONLY=1: the CPU engine's linear kernels on this host's CPU and compiler, nothing of CUDA: fast._core built
  # with GLM_ENABLE_CUDA=OFF, the instruction-set tests and the linear kernels' tests, then tools/bench_cpu.py's
  # GEMMs by build (CPU_TOKENS, CPU_SHAPE, CPU_THREADS). CPU_BASE=FILE.tar (a `git archive` of another commit,
  # carried in): that tree is built too and the two benchmarks run by turns, CPU_ROUNDS rounds. CPU_WIDE=N: the
  # GEMMs once more on N threads (CPU_WIDE_TOKENS). CPU_AB="VAR=VALUE ...": the GEMMs again with each setting
  # (e.g. GLM_CPU_FP8_DIRECT=1).
  phase "CPU only: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2); $(gcc --version | head -1)"
  grep -m1 flags /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|fma|avx512f|avx512vl|avx512bw|amx_bf16)$' | tr '\n' ' '; echo
  cpu_build() {  # $1 source tree, $2 build dir
    cmake -S "$1" -B "$2" -DCMAKE_BUILD_TYPE=Release -DGLM_ENABLE_CUDA=OFF -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" \
      > "$OUT/cmake_cpu_$(basename "$2").log" 2>&1 || { tail -30 "$OUT/cmake_cpu_$(basename "$2").log"; return 1; }
    cmake --build "$2" -j"$(nproc)" --target _core > "$OUT/build_cpu_$(basename "$2").log" 2>&1 \
      || { grep -E "error" -A6 "$OUT/build_cpu_$(basename "$2").log" | head -60; return 1; }
    grep -c "warning" "$OUT/build_cpu_$(basename "$2").log" | sed 's/^/build warnings: /'
  }
  cpu_build . /tmp/glm-cpu || exit 1
  python3 -c "from fast import _core; print('kernels:', _core.cpu_kernels())"
  echo "built at $(elapsed) s"
  if [ -n "${CPU_BASE:-}" ]; then
    rm -rf /tmp/cpu-base && mkdir -p /tmp/cpu-base && tar -xf "$CPU_BASE" -C /tmp/cpu-base && cpu_build /tmp/cpu-base /tmp/glm-cpu-base || exit 1
    echo "base built at $(elapsed) s"
  fi
  phase "CPU tests: tests/test_cpu_kernels_isa.py, the linear kernels (tests/test_cpu_primitives.py -k linear)"
  python3 -m pytest -q -rs -p no:cacheprovider tests/test_cpu_kernels_isa.py 2>&1 | tail -8
  python3 -m pytest -q -rs -p no:cacheprovider tests/test_cpu_primitives.py -k linear 2>&1 | tail -8
  ARGS="--gemm --shape ${CPU_SHAPE:-16384x4096} --tokens ${CPU_TOKENS:-2,3,4,6,7,8,16,64} --threads ${CPU_THREADS:-1} --kernels avx2,avx512"
  for round in $(seq 1 "${CPU_ROUNDS:-1}"); do
    if [ -n "${CPU_BASE:-}" ]; then
      phase "round $round, base: tools/bench_cpu.py $ARGS"
      (cd /tmp/cpu-base && PYTHONPATH=. python3 tools/bench_cpu.py $ARGS)
    fi
    phase "round $round: tools/bench_cpu.py $ARGS"
    PYTHONPATH=. python3 -c "from fast import _core; print('FMA peak, 1 thread, MAC/ns, by build:', {k: round(_core.engine_bench_fma(1, 5, kernels=k), 1) for k in _core.cpu_kernels()['available']})"
    PYTHONPATH=. python3 tools/bench_cpu.py $ARGS
  done
  for setting in ${CPU_AB:-}; do  # CPU_AB="VAR=VALUE ...": the final build's GEMMs again with each setting
    phase "with $setting: tools/bench_cpu.py $ARGS"
    env "$setting" PYTHONPATH=. python3 tools/bench_cpu.py $ARGS
  done
  if [ -n "${CPU_WIDE:-}" ]; then  # CPU_WIDE=THREADS: the final build on that many threads too
    phase "tools/bench_cpu.py --gemm --shape ${CPU_SHAPE:-16384x4096} --tokens ${CPU_WIDE_TOKENS:-8,64} --threads $CPU_WIDE --kernels avx2,avx512"
    PYTHONPATH=. python3 tools/bench_cpu.py --gemm --shape "${CPU_SHAPE:-16384x4096}" --tokens "${CPU_WIDE_TOKENS:-8,64}" --threads "$CPU_WIDE" --kernels avx2,avx512
  fi
  phase "done"
  exit 0
fi

phase "wheels"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__)"

phase "slice checkpoints: generating in the background ($LAYERS layers, $EXPERTS experts, $RELEASES) into $SLICE"
MAKE_PID=""
HAVE=1
for r in ${RELEASES//,/ }; do [ -f "$SLICE/slice-$r/config.json" ] || HAVE=0; done
if [ "${FLASH:-0}" = "1" ]; then
  # the flash checkpoint instead (41.2 GiB: the disk does not hold both); the slice phases find no slice
  echo "skipped: FLASH=1 makes flash-fp8 into ${FLASH_DIR:-/tmp/flash} instead"
  mkdir -p "${FLASH_DIR:-/tmp/flash}"
  ( NUMBA_NUM_THREADS=2 python3 -c "from tools.zoo import make_checkpoint; make_checkpoint('flash', 'fp8', '${FLASH_DIR:-/tmp/flash}/flash-fp8', workers=$(( $(nproc) / 2 )))" \
      > "$OUT/flash_make.log" 2>&1; echo "exit $?" >> "$OUT/flash_make.log" ) &
  MAKE_PID=$!
elif [ "$HAVE" = 1 ]; then
  echo "present"
else
  (  # one process per release, in parallel, each with a few workers of two threads: the GPU tests'
     # oracle references (Numba, OpenMP) crawl when the machine's cores are oversubscribed
    for r in ${RELEASES//,/ }; do
      NUMBA_NUM_THREADS=2 OMP_NUM_THREADS=2 python3 tools/bench_cuda.py --slice-dir "$SLICE" --make-only --layers "$LAYERS" --experts "$EXPERTS" --releases "$r" \
        --workers $(( $(nproc) / 6 + 1 )) \
        > "$OUT/slice_make_$r.log" 2>&1 &
    done
    wait; cat "$OUT"/slice_make_*.log > "$OUT/slice_make.log"; echo "exit $?" >> "$OUT/slice_make.log" ) &
  MAKE_PID=$!
fi

SMALL=${SMALL_DIR:-/tmp/zoo-small}
SMALL_PID=""
if [ "${SERVE:-0}" = "1" ] && [[ "${SERVE_STEPS:-abcde}" == *c* ]] && [ ! -f "$SMALL/small-fp8/config.json" ]; then
  # small-fp8 for the serving phase's CPU figure (~1 min), made next to the slice
  ( NUMBA_NUM_THREADS=2 python3 -c "from tools.zoo import make_checkpoint; make_checkpoint('small', 'fp8', '$SMALL/small-fp8')" \
      > "$OUT/small_make.log" 2>&1; echo "exit $?" >> "$OUT/small_make.log" ) &
  SMALL_PID=$!
fi

phase "build (fast._core + fast._cuda, sm_90)"
# PREBUILT=1: modules built elsewhere for this Python (carried into fast/) are used when they import;
# the build runs only when they do not (a build costs ~3 minutes of device time).
if [ "${PREBUILT:-0}" = "1" ] && python3 -c "import fast._core, fast._cuda" 2> "$OUT/prebuilt.log"; then
  echo "prebuilt modules: $(ls fast/_core*.so fast/_cuda*.so | tr '\n' ' ')"
else
[ "${PREBUILT:-0}" = "1" ] && { echo "prebuilt modules do not import; building"; tail -3 "$OUT/prebuilt.log"; }
GEN=""
command -v ninja > /dev/null && GEN="-G Ninja"
if ! cmake -S . -B /tmp/glm-build $GEN -DCMAKE_BUILD_TYPE=Release -DGLM_FORCE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
     -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" > "$OUT/cmake.log" 2>&1; then
  tail -40 "$OUT/cmake.log"; exit 1
fi
if ! cmake --build /tmp/glm-build -j"$(nproc)" > "$OUT/build.log" 2>&1; then
  grep -E "error" -A6 "$OUT/build.log" | head -120; tail -20 "$OUT/build.log"; exit 1
fi
grep -c "warning" "$OUT/build.log" | sed 's/^/build warnings: /'
fi
python3 - <<'EOF'
import fast._cuda as c
from fast.cuda import cuda_available
print("fast._cuda imports; device answers:", cuda_available(), "| e8m0(125..129):", c.decode_table("e8m0")[125:130])
EOF
echo "built at $(elapsed) s"

phase "device expf census (all 2^32 inputs, on the device, against the canonical device expf)"
python3 - <<'EOF2'
import fast._cuda as c
for kind in ("canonical", "expf", "__expf"):
    r = c.expf_census(kind)
    first = "-" if r["first"] is None else f"0x{r['first']:08x}"
    print(f"{kind:9s} differ {r['differ']:>11,} ({100 * r['differ'] / r['inputs']:.3f}%)  after bf16 {r['differ_bf16']:>10,}"
          f"  x<=0: {r['differ_nonpos']:>11,} of {r['nonpos_inputs']:,}  max ulp {r['max_ulps']}  first {first}"
          f"  ({r['seconds']:.2f} s)")
EOF2

# loads the compiler put before a kernel's PDL wait (docs/engine_cuda.md, "PDL"): seconds, and it reads the module only
MOD=$(ls fast/_cuda.cpython-*.so 2>/dev/null | head -1)
[ -n "$MOD" ] && python3 tools/pdl_sass_check.py "$MOD" 2>&1 | tail -8

if [ "${TESTS:-1}" != "0" ]; then
phase "GPU tests (tests/test_fast_cuda.py, tests/test_head_bound.py, the cuda side of tests/test_engines.py; the slice test comes last)"
T_TESTS=$(( $(left) - 230 )); [ "$T_TESTS" -lt 150 ] && T_TESTS=150  # the quick set takes 50-100 s
SEL="not slice"
[ "${TESTS:-1}" = "quick" ] && SEL="not slice and not exhaustive and not census and not small-bf16"
[ -n "${TESTS_K:-}" ] && SEL="$TESTS_K"
SEL="($SEL) and not linear_kernels and not cuda-ranks-r2 and not cuda-ranks-r3"  # (those: the EP phase)
timeout "$T_TESTS" python3 -m pytest tests/test_fast_cuda.py tests/test_head_bound.py tests/test_engines.py tests/test_index_select.py tests/test_index_scores.py tests/test_mla_softmax.py tests/test_greedy_logprob.py tests/test_memory.py tests/test_long_context.py -m gpu -v -rsP -p no:cacheprovider --durations=15 -k "$SEL" \
  > "$OUT/pytest.log" 2>&1
echo "pytest exit $? (limit $T_TESTS s)"
grep -E " (PASSED|FAILED|ERROR|SKIPPED)" "$OUT/pytest.log" | sed -E "s/^tests.test_fast_cuda.py:://" | cut -c1-110
grep -E "passed|failed|error" "$OUT/pytest.log" | tail -3
grep -E "^(FAILED|ERROR)|Error|assert|first divergence|differ" "$OUT/pytest.log" | head -60
grep -E "exhaustive device expf|^expf \{|^__expf \{" "$OUT/pytest.log" | head -5
sed -n '/slowest/,/^$/p' "$OUT/pytest.log" | head -20

phase "the linear kernels one by one, real-model shapes (tests/test_fast_cuda.py::test_linear_kernels_match_cpu)"
if [ "${LINEAR_TESTS:-1}" = "0" ]; then echo "skipped: LINEAR_TESTS=0"; else
timeout 180 python3 -X faulthandler -m pytest tests/test_fast_cuda.py -v -rs -p no:cacheprovider -k linear_kernels \
  > "$OUT/pytest_linear.log" 2>&1
RC=$?
echo "linear kernel tests exit $RC"
if [ "$RC" = 139 ]; then  # a crash in the CPU reference: where (gdb when present), and the CPU
  grep -m1 "model name" /proc/cpuinfo; grep -o -w -E "avx2|fma|f16c|avx512f" /proc/cpuinfo | sort | uniq -c | tr '\n' ' '; echo
  cat > /tmp/crash.py <<'EOP'
import numpy as np
from fast import _core
rng = np.random.default_rng(0)
q = rng.integers(0, 256, (8192, 4096), dtype=np.uint8); q[(q & 0x7F) == 0x7F] = 0x7E
s = ((rng.random((64, 32), dtype=np.float32) + 0.5) * np.float32(2.0 ** -7)).astype(np.float32)
x = rng.standard_normal(4096, dtype=np.float32)
print("matvec_fp8", _core.matvec_fp8(q, s, x, threads=1)[:2], flush=True)
print("linear", _core.linear("fp8", q, s, x[None], round=True, threads=1)[0, :2], flush=True)
EOP
  if command -v gdb > /dev/null; then
    timeout 60 gdb -q -batch -ex run -ex bt -ex "info registers rip" -ex "x/6i \$pc" --args python3 /tmp/crash.py 2>&1 | grep -v "^\[" | tail -30
  else
    timeout 60 python3 -X faulthandler /tmp/crash.py 2>&1 | tail -5; echo "(no gdb)"
  fi
fi
grep -E "PASSED|FAILED|passed|failed|error|differ|Fatal|File \"/work" "$OUT/pytest_linear.log" | cut -c1-120 | head -40
fi
fi

if [ -n "${MAKE_PID:-}" ]; then
  phase "waiting for the slice checkpoints"
  wait "$MAKE_PID"
fi
cat "$OUT/slice_make.log" "$OUT/flash_make.log" 2>/dev/null
df -h /tmp | tail -1

phase "slice: CUDA engine = CPU engine at real widths"
T_SLICE=$(( $(left) - 90 )); [ "$T_SLICE" -gt 300 ] && T_SLICE=300  # (the 8K test: the CPU engine prefills 8,192 tokens)
if [ "${TESTS:-1}" = "0" ] || [ "${SLICE_TESTS:-1}" = "0" ]; then
  echo "skipped: TESTS=0 or SLICE_TESTS=0"
elif [ "${FLASH:-0}" = "1" ]; then
  echo "skipped: FLASH=1 (no slice on the disk; the flash phase compares the engines at full depth)"
elif [ "$T_SLICE" -gt 30 ]; then
  GLM_SLICE_DIR="$SLICE" timeout "$T_SLICE" python3 -m pytest tests/test_fast_cuda.py tests/test_long_context.py -q -rs -p no:cacheprovider --durations=5 -k slice \
    > "$OUT/pytest_slice.log" 2>&1
  echo "slice test exit $? (limit $T_SLICE s)"
  grep -E "passed|failed|error|first divergence|assert" "$OUT/pytest_slice.log" | head -20
else
  echo "skipped: no time left"
fi

if [ "${SERVE:-0}" = "1" ]; then
  # issues 20 and 21 on the device (docs/serve.md, "GPU acceptance"); each step under its own limit, on
  # after a failure. Its lines "serve c16 / offline b16 = ...", the bench_speculate table and "TTFT ..."
  # go to docs/perf.md as printed.
  cap() { local t=$(( $(left) - 10 )); [ "$t" -gt "$1" ] && t=$1; [ "$t" -lt 5 ] && t=5; echo "$t"; }  # (timeout 0: none)
  SLICE8="$SLICE/slice-fp8"
  [ -f "$SLICE8/config.json" ] || echo "no $SLICE8: the slice steps are skipped"
  NCPU=$(nproc); HALF=$(( NCPU / 2 )); CPU_THREADS=${SERVE_CPU_THREADS:-$(( HALF > 3 ? HALF - 2 : 1 ))}
  SCPUS="0-$(( HALF - 1 ))"; CCPUS="$HALF-$(( NCPU - 1 ))"   # the server's cores, the clients' (and offline's)
  PIN="taskset -c $CCPUS"; command -v taskset > /dev/null || { PIN=""; echo "no taskset: the clients are not pinned"; }

  STEPS=${SERVE_STEPS:-abcde}
  step() { case "$STEPS" in *"$1"*) return 0;; *) echo "(serve $1: not in SERVE_STEPS=$STEPS)"; return 1;; esac; }

  if step a; then
  phase "serve a: server tests, the server on the CUDA engine (GLM_SERVE_ENGINE=cuda; references: CPU engine)"
  GLM_SERVE_ENGINE=cuda timeout "$(cap 240)" python3 -m pytest -q -rs -p no:cacheprovider --maxfail=5 --durations=8 \
    tests/test_serve.py tests/test_prefix_cache.py tests/test_prefix_disk.py tests/test_speculate.py \
    -k "(serve or prefix or replay_gate) and not slice and not small" > "$OUT/pytest_serve.log" 2>&1
  echo "server tests exit $?"
  grep -E "^(FAILED|ERROR)|passed|failed|error|assert" "$OUT/pytest_serve.log" | head -30
  sed -n '/slowest/,/^$/p' "$OUT/pytest_serve.log" | head -10
  fi

  if step b; then
  phase "serve b: the replay gate on slice-fp8, CUDA engine (tests/test_speculate.py::test_the_replay_gate_on_slice)"
  GLM_SLICE_DIR="$SLICE" timeout "$(cap 200)" python3 -m pytest -v -rs -p no:cacheprovider --durations=3 \
    tests/test_speculate.py -k replay_gate_on_slice > "$OUT/pytest_serve_gate.log" 2>&1
  echo "replay gate exit $?"
  grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed|assert|Error" "$OUT/pytest_serve_gate.log" | head -20
  fi

  if step c; then
  phase "serve c: server overhead, concurrency 16 vs offline generate at batch 16 (server on cores $SCPUS, clients on $CCPUS)"
  SMALL_OK=1
  if [ -n "$SMALL_PID" ]; then
    while kill -0 "$SMALL_PID" 2> /dev/null && [ "$(left)" -gt 60 ]; do sleep 2; done
    cat "$OUT/small_make.log"; grep -q "^exit 0" "$OUT/small_make.log" || SMALL_OK=0
  fi
  LOAD="--concurrency 16 --requests 128 --prompt 32 --repeats 3 --server-cpus $SCPUS"
  if [ "$SMALL_OK" = 1 ] && [ -f "$SMALL/small-fp8/config.json" ]; then
    timeout "$(cap 150)" $PIN python3 -m tools.serve bench --checkpoint "$SMALL/small-fp8" \
      --engine "cpu:threads=$CPU_THREADS" $LOAD --new 32 > "$OUT/serve_overhead_cpu.log" 2>&1
    echo "cpu overhead exit $?"; tail -6 "$OUT/serve_overhead_cpu.log"
  fi
  if [ -f "$SLICE8/config.json" ]; then
    timeout "$(cap 180)" $PIN python3 -m tools.serve bench --checkpoint "$SLICE8" --engine cuda \
      $LOAD --new 64 > "$OUT/serve_overhead_cuda.log" 2>&1
    echo "cuda overhead exit $?"; tail -6 "$OUT/serve_overhead_cuda.log"
    for ab in ${SERVE_AB:-}; do   # the CUDA figure again with each setting, e.g. SERVE_AB="GLM_SWITCH=0.0005"
      echo "--- with $ab"
      env "$ab" timeout "$(cap 180)" $PIN python3 -m tools.serve bench --checkpoint "$SLICE8" --engine cuda \
        $LOAD --new 64 > "$OUT/serve_overhead_cuda_${ab//[^A-Za-z0-9]/_}.log" 2>&1
      echo "cuda overhead ($ab) exit $?"; tail -6 "$OUT/serve_overhead_cuda_${ab//[^A-Za-z0-9]/_}.log"
    done
  fi
  fi

  if [ -f "$SLICE8/config.json" ] && step d; then
    phase "serve d: speculation on the CUDA engine, slice-fp8 (tools/bench_speculate.py)"
    DRAFT=""; [ -f "$SLICE/slice-mxfp4/config.json" ] && DRAFT="--drafter $SLICE/slice-mxfp4"
    timeout "$(cap 180)" python3 -m tools.bench_speculate --checkpoint "$SLICE8" --device cuda --k 2,4,8 --new 128 \
      --repeats 5 $DRAFT 2>&1 | tee "$OUT/bench_speculate_cuda.log" | grep -v -E "^(Warning|  warnings)"
    echo "speculation bench exit $?"
  fi
  if [ -f "$SLICE8/config.json" ] && step e; then
    phase "serve e: TTFT on a cached 4096-token prefix vs a miss, through the server (CUDA, slice-fp8; tools/bench_prefix.py)"
    timeout "$(cap 150)" python3 -m tools.bench_prefix --checkpoint "$SLICE8" --engine cuda --prefix 4096 --tail 20 \
      --repeats 5 2>&1 | tee "$OUT/bench_prefix_cuda.log"
    echo "prefix bench exit $?"
  fi
fi

NGPU=$(nvidia-smi -L | wc -l)
if [ "${EP:-1}" != "0" ] && [ "$NGPU" -ge 2 ]; then
  # expert parallelism over this host's GPUs (docs/ep.md, "GPU"): the tests (tiny and small over 2 and 3
  # ranks, slice over 2) and decode on slice-fp8 over EP_RANKS GPUs against one
  phase "expert parallelism over $NGPU GPUs (tests/test_ep_cuda.py, tools/bench_ep_cuda.py)"
  T_EP=$(( $(left) / 2 )); [ "$T_EP" -lt 60 ] && T_EP=60
  GLM_SLICE_DIR="$SLICE" GLM_EP_TIMEOUT=120 timeout "$T_EP" python3 -m pytest tests/test_ep_cuda.py tests/test_engines.py -v -rs -p no:cacheprovider \
    -k "test_ep_cuda or cuda-ranks-r2 or cuda-ranks-r3" \
    > "$OUT/pytest_ep.log" 2>&1
  echo "EP tests exit $? (limit $T_EP s)"
  grep -E "PASSED|FAILED|SKIPPED|passed|failed|Error" "$OUT/pytest_ep.log" | grep -v "^\[rank" | head -30
  if [ -f "$SLICE/slice-fp8/config.json" ]; then
    GLM_EP_TIMEOUT=120 timeout $(( $(left) - 20 )) python3 tools/bench_ep_cuda.py --checkpoint "$SLICE/slice-fp8" \
      --ranks "${EP_RANKS:-$NGPU}" --steps 64 --json "$OUT/bench_ep.json" 2>&1 | grep -v "^\[rank"
    echo "EP bench exit $?"
    GLM_EP_TIMEOUT=120 GLM_EP_QUIET=1 timeout $(( $(left) - 10 )) python3 -m fast.launch --ranks "${EP_RANKS:-$NGPU}" -- \
      python3 tools/bench_ep_cuda.py --checkpoint "$SLICE/slice-fp8" --steps 64 --json "$OUT/bench_ep_spmd.json" 2>&1 \
      | grep -v "^\[rank"
    echo "EP bench (launched) exit $?"
  fi
fi

if [ "${BENCH:-1}" != "0" ]; then
phase "benchmarks (tools/bench_cuda.py)"
PEER=""
[ "${SKIP_PEER:-0}" = "1" ] && PEER="--no-peer"
T_BENCH=$(( $(left) - 60 )); [ "$T_BENCH" -lt 60 ] && T_BENCH=60
timeout "$T_BENCH" python3 tools/bench_cuda.py --slice-dir "$SLICE" --layers "$LAYERS" --experts "$EXPERTS" \
  --json "$OUT/bench.json" --releases "$RELEASES" $PEER
echo "bench exit $? (limit $T_BENCH s)"

for setting in ${AB:-}; do
  # the same decode with one engine setting changed (e.g. GLM_PDL=0, GLM_EXPERT_TILE=4), in this run
  phase "A/B: decode with $setting"
  env "$setting" timeout 150 python3 tools/bench_cuda.py --slice-dir "$SLICE" --layers "$LAYERS" --experts "$EXPERTS" \
    --json "$OUT/bench_${setting//[^A-Za-z0-9]/_}.json" --releases "${RELEASES%%,*}" --no-peer --prefill 0 2>&1 | grep -v "one-token kernel"
done
if compgen -G ".variants/*.so" > /dev/null; then
  # other builds of fast._cuda (branches built elsewhere, carried in .variants/NAME.so), same benchmark
  MOD=$(ls fast/_cuda.cpython-*.so | head -1)
  cp "$MOD" /tmp/_cuda_main.so
  for v in .variants/*.so; do
    phase "variant $(basename "$v" .so): tools/bench_cuda.py with $v as fast._cuda"
    cp "$v" "$MOD"
    timeout 150 python3 tools/bench_cuda.py --slice-dir "$SLICE" --layers "$LAYERS" --experts "$EXPERTS" \
      --json "$OUT/bench_$(basename "$v" .so).json" --releases "${RELEASES%%,*}" --no-peer ${VARIANT_PREFILL:+--prefill "$VARIANT_PREFILL"} \
      2>&1 | grep -v "one-token kernel"
  done
  cp /tmp/_cuda_main.so "$MOD"
fi

fi

if [ "${FLASH:-0}" = "1" ]; then
  phase "flash: 45 layers at real widths, 32 experts (tools/bench_flash.py)"
  cat "$OUT/flash_make.log"
  timeout $(( $(left) - 10 )) python3 tools/bench_flash.py --dir "${FLASH_DIR:-/tmp/flash}" --json "$OUT/bench_flash.json"
  echo "flash exit $?"
fi

if [ -n "${CONTEXT:-}" ] && [ -f "$SLICE/slice-fp8/config.json" ]; then
  # long context (tools/bench_context.py): decode b1 and prefill as the context grows; CONTEXT is the
  # list of contexts (e.g. 1024,16384,131072)
  phase "long context on slice-fp8 (tools/bench_context.py: $CONTEXT)"
  timeout $(( $(left) - 10 )) python3 tools/bench_context.py --checkpoint "$SLICE/slice-fp8" --contexts "$CONTEXT" \
    --json "$OUT/bench_context.json"
  echo "context bench exit $?"
  if [ -n "${CONTEXT_AB:-}" ]; then  # the same with each engine setting, e.g. CONTEXT_AB="GLM_ATTN_TILED=1"
    for setting in $CONTEXT_AB; do
      phase "long context with $setting"
      env "$setting" timeout $(( $(left) - 10 )) python3 tools/bench_context.py --checkpoint "$SLICE/slice-fp8" \
        --contexts "$CONTEXT" --json "$OUT/bench_context_${setting//[^A-Za-z0-9]/_}.json"
      echo "context bench ($setting) exit $?"
    done
  fi
fi

if [ "${THROUGHPUT:-0}" = "1" ]; then
  # issue 19's table: decode b1..b256 and prefill 512..16384, engine and warmed peer in one process, each
  # against the step roofline (tools/bench_throughput.py); THROUGHPUT_ARGS e.g. "--no-peer --batches 128"
  for rel in ${RELEASES//,/ }; do
    [ -f "$SLICE/slice-$rel/config.json" ] || continue
    phase "throughput on slice-$rel: engine and warmed peer (tools/bench_throughput.py)"
    timeout $(( $(left) - 10 )) python3 tools/bench_throughput.py --checkpoint "$SLICE/slice-$rel" \
      --json "$OUT/throughput_$rel.json" ${THROUGHPUT_ARGS:-} 2>&1 | grep -v -E "^(Warning|  warnings)"
    echo "throughput ($rel) exit ${PIPESTATUS[0]}"
  done
fi

if [ -n "${NCU_KERNELS:-}" ] && command -v ncu > /dev/null; then
  # the engine's own launches (not a kernel benchmark): every section, and the stall samples per SASS
  # instruction (the source page) to say which instructions a latency-bound kernel waits on
  phase "ncu: engine kernels /${NCU_KERNELS}/ in decode steps at batch 1 (${RELEASES%%,*})"
  timeout 300 ncu --clock-control none --set full --kernel-name "regex:${NCU_KERNELS}" --launch-skip "${NCU_SKIP:-16}" \
    --launch-count "${NCU_KCOUNT:-4}" -f -o "$OUT/ncu_engine" \
    python3 tools/profile_cuda.py --checkpoint "$SLICE/slice-${RELEASES%%,*}" --plain --steps 3 > "$OUT/ncu_engine.log" 2>&1
  echo "ncu exit $?"; tail -3 "$OUT/ncu_engine.log"
  ncu -i "$OUT/ncu_engine.ncu-rep" --page details > "$OUT/ncu_engine_details.txt" 2>&1
  ncu -i "$OUT/ncu_engine.ncu-rep" --page source --print-source sass --csv > "$OUT/ncu_engine_sass.csv" 2>&1
  python3 tools/ncu_blocks.py "$OUT/ncu_engine_sass.csv" --blocks 4 | head -40
  grep -E "^  [a-z_]|Duration|DRAM Throughput|Issue Slots Busy|Executed Instructions  |Achieved Occupancy|Registers Per|Eligible Warps|Block Limit|Theoretical Occ" \
    "$OUT/ncu_engine_details.txt" | head -60
  wc -c "$OUT"/ncu_engine_*
fi

if [ "${PROFILE:-0}" = "1" ]; then
  phase "kernel timeline of decode steps (tools/profile_cuda.py)"
  for r in ${RELEASES//,/ }; do
    for b in ${PROFILE_BATCHES:-1 8}; do
      timeout 120 env ${PROFILE_ENV:-GLM_PDL=1} python3 tools/profile_cuda.py --checkpoint "$SLICE/slice-$r" --batch $b --trace "$OUT/trace-$r-b$b.json" \
        2>&1 | grep -v -E "^(STAGE|Warning|  warnings)" | head -70
    done
  done
  gzip -f "$OUT"/trace-*.json 2>/dev/null
fi

if [ -n "${NCU_GEMM:-}" ] && command -v ncu > /dev/null; then
  # a several-token kernel on one shape of tools/bench_gemm.py (NCU_GEMM: its --only, e.g. kda; T from
  # NCU_GEMM_T, default 512; NCU_GEMM_KERNELS: bench_gemm's kernel names, default gemm, e.g. "gemm pairs"):
  # every section, then where its instructions and stalls go (tools/ncu_blocks.py)
  for kern in ${NCU_GEMM_KERNELS:-gemm}; do
    kname=k_linear_${kern%%:*}  # (bench_gemm's gemm, pairs, lanes: k_linear_gemm, k_linear_pairs, k_linear_lanes)
    phase "ncu: $kname ($kern) on ${NCU_GEMM} at T = ${NCU_GEMM_T:-512} (tools/bench_gemm.py)"
    timeout 150 ncu --clock-control none --set full --import-source no -k "regex:$kname" -s 2 -c 1 -f -o "$OUT/ncu_$kern" \
      python3 tools/bench_gemm.py --only "$NCU_GEMM" --tokens "${NCU_GEMM_T:-512}" --kernels "$kern" --reps 1 > "$OUT/ncu_$kern.log" 2>&1
    echo "ncu exit $?"
    ncu -i "$OUT/ncu_$kern.ncu-rep" --page details > "$OUT/ncu_${kern}_details.txt" 2>&1
    ncu -i "$OUT/ncu_$kern.ncu-rep" --page source --print-source sass --csv > "$OUT/ncu_${kern}_sass.csv" 2>&1
    grep -E "Duration|Issue Slots Busy|Executed Ipc Active|Achieved Occupancy|Registers Per|Eligible Warps|L1/TEX Cache Throughput|DRAM Throughput|Shared" \
      "$OUT/ncu_${kern}_details.txt" | head -16
    python3 tools/ncu_blocks.py "$OUT/ncu_${kern}_sass.csv" --blocks 5
  done
fi
if [ "${NCU:-0}" = "1" ] && command -v ncu > /dev/null; then
  # hardware counters of the routed-expert kernels (the largest gap to the roofline in decode), with the
  # warp stall reasons per issued instruction; NCU_ONLY / NCU_VARIANTS: other shapes (tools/bench_linear.py
  # names) and kernel variants
  phase "ncu: linear kernels ${NCU_ONLY:-experts.gate x18} (${NCU_VARIANTS:-stream:2,register:occ5}): speed of light, issue, stalls"
  STALLS=""
  for r in long_scoreboard short_scoreboard wait not_selected selected math_pipe_throttle mio_throttle lg_throttle \
           barrier branch_resolving dispatch_stall no_instruction imc_miss membar sleeping drain misc tex_throttle; do
    STALLS="${STALLS:+$STALLS,}smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"
  done
  timeout 240 ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats \
    --section WarpStateStats --section InstructionStats --section LaunchStats --section Occupancy --metrics "$STALLS" \
    -k regex:k_linear -c "${NCU_COUNT:-4}" \
    python3 tools/bench_linear.py --only "${NCU_ONLY:-experts.gate x18}" --reps 1 --variants "${NCU_VARIANTS:-stream:2,register:occ5}" \
    > "$OUT/ncu_experts.txt" 2>&1
  echo "ncu exit $?"; grep -E "k_linear|Duration|DRAM Throughput|Issue Slots|Executed Instructions  |Achieved Occupancy|Registers Per|Eligible Warps|stalled" \
    "$OUT/ncu_experts.txt" | sed -E 's/smsp__average_warps_issue_stalled_(\S+)_per_issue_active.ratio/stall \1/' | head -80
fi
if [ -n "${SASS:-}" ] && command -v cuobjdump > /dev/null; then
  # the SASS of the kernels whose mangled names match the regex SASS (e.g. 'k_linear_stream.*ILi2ELb1ELi1E'),
  # into $OUT/kernels.sass, with the instruction mix of each function
  phase "SASS of /${SASS}/"
  cuobjdump -sass fast/_cuda.cpython-*.so | awk -v re="$SASS" '/Function :/{p = ($0 ~ re)} p' > "$OUT/kernels.sass"
  awk '/Function :/{f=$3} /^ +\/\*[0-9a-f]+\*\/ /{op=$2; if (op ~ /^@/) op=$3; sub(/\..*/, "", op); n[f" "op]++}
       END{for (k in n) print n[k], k}' "$OUT/kernels.sass" | sort -k2,2 -k1,1nr | awk '{c[$2]++; if (c[$2] <= 12) print}' \
    | sed -E 's/_ZN3glm4cuda[0-9]+_GLOBAL__N__[0-9a-f_]+_cu_[0-9a-f]+//' | head -80  # (static counts: the code, not its execution)
fi
if [ "${LINEAR_BENCH:-0}" = "1" ]; then
  phase "the linear kernels one by one, timed (tools/bench_linear.py)"
  timeout 120 python3 tools/bench_linear.py --reps 15 --json "$OUT/bench_linear.json" \
    ${LINEAR_ONLY:+--only "$LINEAR_ONLY"} ${LINEAR_VARIANTS:+--variants "$LINEAR_VARIANTS"} 2>&1 | tail -22
fi
phase "done"
