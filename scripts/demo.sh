#!/usr/bin/env bash
# Set up (if needed), start `parrot serve` on the default model (SmolLM2-135M),
# run each example application against it both ways -- as semantic functions
# (Parrot) and as a request-level client (one /v1/completions per call) --
# with the same emulated network delay per HTTP request, and stop the server.
# PARROT_DEMO_DELAY_MS sets the delay (default 250).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
PORT=${PARROT_PORT:-9000}
URL="http://127.0.0.1:$PORT"
log=$(mktemp -t parrot-serve.XXXXXX.log)
parrot serve --port "$PORT" >"$log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true; wait $server 2>/dev/null || true' EXIT
echo "starting parrot serve (log: $log) ..."
for _ in $(seq 1 600); do
  if curl -fs "$URL/healthz" >/dev/null 2>&1; then break; fi
  if ! kill -0 $server 2>/dev/null; then cat "$log"; echo "parrot serve exited" >&2; exit 1; fi
  sleep 0.5
done
grep -m1 "manager ready" "$log" || true
DELAY_MS=${PARROT_DEMO_DELAY_MS:-250}
echo
echo "Each app runs twice on this server: as semantic functions (Parrot: all calls"
echo "submitted in one request, values flow between them inside the server, only the"
echo "final value is fetched) and as a request-level client (it renders each prompt"
echo "itself, sends one POST /v1/completions per call, and waits for an answer before"
echo "sending the call that needs it). Every HTTP request of either way pays an"
echo "emulated network round trip of $DELAY_MS ms."
for app in qa_chain chain_summary map_reduce; do
  case $app in
    qa_chain) title="question-and-answer chain (5 short calls)" ;;
    chain_summary) title="chain summarisation" ;;
    map_reduce) title="map-reduce summarisation" ;;
  esac
  echo
  echo "=== $title ==="
  python "examples/$app.py" --url "$URL" --delay-ms "$DELAY_MS"
done
