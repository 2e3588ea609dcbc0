#!/usr/bin/env bash
# Set up (if needed), start `parrot serve` on the default model (SmolLM2-135M),
# run the example applications against it, and stop the server.
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
echo
echo "=== chain summarisation ==="
python examples/chain_summary.py --url "$URL"
echo
echo "=== map-reduce summarisation ==="
python examples/map_reduce.py --url "$URL"
