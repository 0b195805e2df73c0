#!/usr/bin/env bash
# Every GPU check of the repository in one command, for the rare session lent a GPU machine
# (an H200 image with PyTorch, Triton and nvcc, and no package index):
#
#   bash scripts/gpu_check.sh [OUT_DIR]     # OUT_DIR default: $OUT, else ./gpu-check-out
#
#  1. environment, carried wheels (gpu-wheels/, from scripts/fetch_gpu_wheels.sh) into a
#     private site directory, the repository's packages (editable, no dependencies), the model
#     (the default model, or a random-weight model of its shape where the 98 MB file cannot
#     travel), the plugin listing with each backend's availability;
#  2. stops there, cleanly, without a CUDA device ("no CUDA device", exit 3: the dry run);
#  3. on a GPU: attention backends vs dense SDPA (benchmarks/bench_gpu.py attention), decode
#     tok/s per backend with and without CUDA graphs (bench_gpu.py decode), float32 CPU vs GPU
#     parity, MLA decode per backend (benchmarks/bench_mla.py), the core's CUDA tests, then
#     every plugin's scripts/gpu_check.sh.
#
# Before anything runs it prints its plan: the steps with their time limits and the carried
# wheels it found. Step 1 ends with one availability row per GPU backend
# (scripts/gpu_availability.py): pass, FAIL (its library is here but the backend reports
# unavailable on a CUDA machine: the probe's reason), or NOT CARRIED (its library is not here;
# never a pass). GPU_CHECK_SIMULATE_CUDA=1 runs those probes as on a one-GPU Hopper machine,
# so a dry run on CPU fails (exit 1) when a wheel here is broken or too old for its backend.
#
# One table at the end (summary.md): every step's result and seconds, then a count of pass /
# FAIL / NOT CARRIED / SKIPPED (budget) rows, then the benchmark tables. Each step has a time
# limit and all share a budget (GPU_CHECK_BUDGET_S, default 450 s) so the whole check ends
# within 8 minutes; steps past the budget say SKIPPED. Kernels compiled on first use
# (FlashInfer's JIT: its precompiled-kernel packages are 281 MB or not on PyPI, over what a
# device run carries) are built in one "warm" step before anything is timed, which reports
# how long it took. Only summary.md and logs.tar.gz are written to OUT_DIR (a device run
# returns few files); the work happens in GPU_CHECK_WORK (default /tmp/radixserve-gpu-check).
# Never resolves anything from an index: pip runs with --no-index.
#
# Exit status: 0 every step passed (or was not carried / skipped by the budget); 1 a step
# failed or timed out; 3 no CUDA device and nothing failed (the dry run).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT_DIR="${1:-${OUT:-gpu-check-out}}"
WORK="${GPU_CHECK_WORK:-/tmp/radixserve-gpu-check}"
BUDGET="${GPU_CHECK_BUDGET_S:-450}"
START=$(date +%s)
mkdir -p "$OUT_DIR" "$WORK"
rm -rf "${WORK:?}"/*.log "$WORK"/steps.md "$WORK"/tables.md
export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
unset TRITON_INTERPRET  # compiled kernels on a GPU, never the interpreter
PIP="python -m pip install --quiet --no-index --no-deps --no-build-isolation"
STEPS="$WORK/steps.md"
TABLES="$WORK/tables.md"
: > "$STEPS"
: > "$TABLES"

left() { echo $(( BUDGET - ($(date +%s) - START) )); }

# run_step NAME LIMIT_S COMMAND...: runs with a time limit (at most what is left of the
# budget), logs to WORK/NAME.log, adds a row to the step table
run_step() {
    local name="$1" limit="$2"; shift 2
    local remaining; remaining=$(left)
    if [ "$remaining" -lt 15 ]; then
        echo "| $name | SKIPPED (budget spent) | 0 |" >> "$STEPS"
        return 0
    fi
    [ "$limit" -gt "$remaining" ] && limit=$remaining
    local t0; t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" > "$WORK/$name.log" 2>&1
    local rc=$? result=pass
    if [ $rc = 124 ] || [ $rc = 137 ]; then result="TIMEOUT (${limit} s)"
    elif [ $rc = 4 ]; then result="NOT CARRIED ($(tail -n 1 "$WORK/$name.log" | tr '|' '/' | cut -c1-100))"
    elif [ $rc != 0 ]; then result="FAIL ($rc)"; fi
    echo "| $name | $result | $(( $(date +%s) - t0 )) |" >> "$STEPS"
    echo "== $name: $result"
    tail -n 4 "$WORK/$name.log"
    return 0
}

finish() {  # write summary.md (steps, then tables) and the logs to OUT_DIR
    {
        echo "# radixserve gpu_check ($(date -u '+%Y-%m-%d %H:%M UTC'), $(( $(date +%s) - START )) s)"
        echo
        cat "$WORK/env.txt" 2>/dev/null
        echo
        echo "| step | result | seconds |"
        echo "|---|---|---|"
        cat "$STEPS"
        echo
        echo "pass $(grep -c '| pass |' "$STEPS") · FAIL $(grep -c '| FAIL\|| TIMEOUT' "$STEPS")" \
             "· NOT CARRIED $(grep -c '| NOT CARRIED' "$STEPS") · SKIPPED (budget) $(grep -c '| SKIPPED' "$STEPS")"
        echo
        cat "$TABLES"
    } > "$OUT_DIR/summary.md"
    tar czf "$OUT_DIR/logs.tar.gz" -C "$WORK" --exclude=site --exclude=model . 2>/dev/null || true
    echo "--- summary ($OUT_DIR/summary.md) ---"
    cat "$OUT_DIR/summary.md"
}

# ------------------------------------------------------------ the plan
echo "gpu_check plan (budget ${BUDGET} s; each step: its time limit, at most what is left):"
echo "  1. environment; carried wheels into $WORK/site (90 s); the repository's packages (150 s);"
echo "     the model (180 s); plugins (60 s); availability of every GPU backend"
echo "     (GPU_CHECK_SIMULATE_CUDA=${GPU_CHECK_SIMULATE_CUDA:-0})"
echo "  2. without CUDA: stop (exit 3, or 1 if a backend whose library is here failed)"
echo "  3. on a GPU: warm (240 s), every plugin's scripts/gpu_check.sh (120 s each:"
echo "     $(ls plugins/*/*/scripts/gpu_check.sh | cut -d/ -f2,3 | tr '\n' ' '))," \
     "core CUDA tests (90 s), bench_attention (90 s), bench_decode (150 s), parity (90 s), bench_mla (60 s)," \
     "bench_moe (90 s), bench_a2a (60 s)"
if ls "${GPU_CHECK_WHEELS:-gpu-wheels}"/*.whl > /dev/null 2>&1; then
    echo "  carried wheels:"
    ls -s --block-size=M "${GPU_CHECK_WHEELS:-gpu-wheels}"/*.whl | sed 's/^/    /'
else
    echo "  carried wheels: none (scripts/fetch_gpu_wheels.sh fetches them where there is an index)"
fi

# ------------------------------------------------------------ 1. before any GPU call
python - > "$WORK/env.txt" 2>&1 <<'PY'
import os, platform
import torch
print(f"- python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"{os.cpu_count()} CPUs")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"- {p.name}, compute capability {p.major}.{p.minor}, {p.total_memory / 2**30:.0f} GiB")
else:
    print("- no CUDA device")
PY
cat "$WORK/env.txt"

# carried wheels (flashinfer, torchao, ...) into a private directory: nothing else changes
SITE="$WORK/site"
WHEELS="${GPU_CHECK_WHEELS:-gpu-wheels}"
if ls "$WHEELS"/*.whl > /dev/null 2>&1; then
    run_step carried_wheels 90 $PIP --upgrade --target "$SITE" "$WHEELS"/*.whl
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "| carried_wheels | none in gpu-wheels/ (run scripts/fetch_gpu_wheels.sh here first) | 0 |" >> "$STEPS"
fi

# the repository's packages, editable, unless this checkout's are installed already
if python -c "import os, sys, radixserve; sys.exit(0 if radixserve.__file__.startswith(os.getcwd()) else 1)" 2>/dev/null; then
    echo "| install_packages | already installed from this checkout | 0 |" >> "$STEPS"
else
    editable=(-e core)
    for dir in plugins/*/*/; do [ -f "$dir/pyproject.toml" ] && editable+=(-e "${dir%/}"); done
    editable+=(-e server)
    run_step install_packages 150 $PIP "${editable[@]}"
fi

run_step model 180 python benchmarks/bench_gpu.py model --out "$WORK/model"
MODEL=$(tail -n 1 "$WORK/model.log")
run_step plugins 60 python -m radixserve.cli plugins
# one row per GPU backend: pass / FAIL (library here, backend unavailable) / NOT CARRIED
python scripts/gpu_availability.py --rows "$STEPS" > "$WORK/availability.log" 2>&1
AVAILABILITY=$?
cat "$WORK/availability.log"

# ------------------------------------------------------------ 2. the dry run ends here
if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA device: gpu_check.sh stops before the first GPU step (dry run: the steps above ran)"
    echo "| cuda | no CUDA device: stopped here | 0 |" >> "$STEPS"
    finish
    [ "$AVAILABILITY" = 0 ] || exit 1
    exit 3
fi

# ------------------------------------------------------------ 3. on the GPU
# kernels built on first use (FlashInfer's JIT) compile here, before anything is timed
run_step warm 240 python benchmarks/bench_gpu.py warm --model "$MODEL"
for script in plugins/*/*/scripts/gpu_check.sh; do
    name=$(echo "$script" | cut -d/ -f2,3 | tr / _)
    run_step "$name" 120 bash "$script" "$WORK/$name"
done
run_step core_cuda_tests 90 python -m pytest -q -rs -p no:cacheprovider tests/test_cuda_graph.py tests/test_hicache.py \
    tests/test_quantization.py -k "cuda or torchao or graph"
run_step bench_attention 90 python benchmarks/bench_gpu.py attention --json "$WORK/attention.json"
run_step bench_decode 150 python benchmarks/bench_gpu.py decode --model "$MODEL" --backends triton,flashinfer,fa3 \
    --batch-sizes 1,16 --json "$WORK/decode.json"
run_step parity_cpu_vs_gpu 90 python benchmarks/bench_gpu.py parity --model "$MODEL"
run_step bench_mla 60 python benchmarks/bench_mla.py --device cuda --context 1024 4096
run_step bench_moe 90 python benchmarks/bench_gpu.py moe --batch-sizes 1,128,2048
run_step bench_a2a 60 python benchmarks/bench_gpu.py a2a

{
    echo "## Attention, one layer (bf16; SDPA over the same K/V laid out dense)"
    echo
    sed -n '/^| shape/,$p' "$WORK/bench_attention.log"
    echo
    echo "## Decode tok/s, $(basename "$MODEL"), 128 new tokens per request"
    echo
    sed -n '/^| backend/,$p' "$WORK/bench_decode.log"
    echo
    echo "## Parity"
    echo
    grep '^greedy float32' "$WORK/parity_cpu_vs_gpu.log"
    echo
    echo "## MLA decode attention, absorbed per backend against the expanded form (float32)"
    echo
    sed -n '/^| context/,$p' "$WORK/bench_mla.log"
    echo
    echo "## Warm-up (kernels compiled on first use)"
    echo
    grep '^warm ' "$WORK/warm.log"
    echo
    echo "## MoE runners against torch_native (bf16, one layer)"
    echo
    sed -n '/^| shape/,$p' "$WORK/bench_moe.log"
    echo
    echo "## DeepEP against torch_distributed"
    echo
    sed -n '/^| tokens/,$p;/^a2a: skipped/p' "$WORK/bench_a2a.log"
    echo
    echo "## Plugin timings (TIMING lines)"
    echo
    cat "$WORK"/*/timings.txt 2>/dev/null | sed 's/^/    /'
} >> "$TABLES" 2>/dev/null
finish
! grep -q "FAIL\|TIMEOUT" "$STEPS"
