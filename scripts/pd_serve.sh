#!/usr/bin/env bash
# Prefill-decode disaggregation on one machine: a prefill server, a decode server and SGLang's
# router in front of them (docs/usage.md, "Prefill-decode disaggregation"). Extra arguments go
# to both servers (e.g. a model path). Ports: PREFILL_PORT (30001), DECODE_PORT (30002),
# BOOTSTRAP_PORT (8998), ROUTER_PORT (30000); TRANSFER (mooncake). Ctrl-C stops all three.
set -euo pipefail
PREFILL_PORT=${PREFILL_PORT:-30001}
DECODE_PORT=${DECODE_PORT:-30002}
BOOTSTRAP_PORT=${BOOTSTRAP_PORT:-8998}
ROUTER_PORT=${ROUTER_PORT:-30000}
TRANSFER=${TRANSFER:-mooncake}
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait' EXIT INT TERM
radixserve serve --port "$PREFILL_PORT" --disaggregation-mode prefill \
    --disaggregation-bootstrap-port "$BOOTSTRAP_PORT" --disaggregation-transfer-backend "$TRANSFER" "$@" &
pids+=($!)
radixserve serve --port "$DECODE_PORT" --disaggregation-mode decode \
    --disaggregation-transfer-backend "$TRANSFER" "$@" &
pids+=($!)
for port in "$PREFILL_PORT" "$DECODE_PORT"; do
    until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do sleep 1; done
done
python -m sglang_router.launch_router --pd-disaggregation \
    --prefill "http://127.0.0.1:$PREFILL_PORT" "$BOOTSTRAP_PORT" --decode "http://127.0.0.1:$DECODE_PORT" \
    --host 127.0.0.1 --port "$ROUTER_PORT" &
pids+=($!)
wait
