#!/usr/bin/env bash
# Every GPU check of the repository, for the rare session that is lent a GPU machine:
# each plugin's scripts/gpu_check.sh (attention triton, MoE triton, ...), then the core's
# CUDA tests (HiCache pinned host pool and copy stream) and a greedy-token comparison of
# the default model on the GPU against the CPU. One summary table at the end.
#
#   bash scripts/gpu_check.sh [OUT_DIR]        # OUT_DIR default: $OUT, else ./gpu-check-out
#
# Never resolves torch from the index (the plugin scripts pin the installed version).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-gpu-check-out}}"
mkdir -p "$OUT_DIR"
unset TRITON_INTERPRET
SUMMARY="$OUT_DIR/summary.txt"
: > "$SUMMARY"

run_step() {  # name, command...
    local name="$1"; shift
    local t0=$(date +%s)
    "$@" > "$OUT_DIR/$name.log" 2>&1
    local rc=$?
    echo "| $name | $([ $rc = 0 ] && echo pass || echo "FAIL ($rc)") | $(( $(date +%s) - t0 )) s |" >> "$SUMMARY"
    tail -n 5 "$OUT_DIR/$name.log"
}

for script in plugins/*/*/scripts/gpu_check.sh; do
    name=$(echo "$script" | cut -d/ -f2,3 | tr / _)
    mkdir -p "$OUT_DIR/$name"
    run_step "$name" bash "$script" "$OUT_DIR/$name"
done

python -m pip install --quiet --disable-pip-version-check --no-deps -e plugins/moe/torch_native >/dev/null 2>&1 || true
run_step core_cuda_tests python -m pytest -q -rs -p no:cacheprovider tests/test_hicache.py -k cuda
# int8/int4 weight-only on CUDA through torchao: its wheel travels in gpu-wheels/ (no index there)
python -m pip install --quiet --disable-pip-version-check --no-deps --no-index --find-links gpu-wheels torchao \
    >/dev/null 2>&1 || true
run_step quantization_cuda python -m pytest -q -rs -p no:cacheprovider tests/test_quantization.py -k "cuda or torchao"
run_step default_model_gpu_vs_cpu python - <<'PY'
import radixserve

prompts = ["The capital of France is", "def fibonacci(n):", "List three colours:"]
params = {"temperature": 0, "max_new_tokens": 24}
outs = {}
for device in ("cpu", "cuda"):
    with radixserve.Engine(device=device, dtype="float32", max_total_tokens=8192) as engine:
        outs[device] = [o["output_ids"] for o in engine.generate(prompts, params)]
same = sum(a == b for a, b in zip(outs["cpu"], outs["cuda"]))
print(f"greedy float32, cpu vs cuda: {same}/{len(prompts)} identical")
raise SystemExit(0 if same == len(prompts) else 1)
PY

echo "--- summary ---"
{ echo "| check | result | seconds |"; echo "|---|---|---|"; cat "$SUMMARY"; } | tee "$OUT_DIR/summary.md"
! grep -q FAIL "$SUMMARY"
