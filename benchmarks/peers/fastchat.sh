#!/usr/bin/env bash
# FastChat (the Parrot paper's serving baseline) as a peer server.
#
#   benchmarks/peers/fastchat.sh setup
#   benchmarks/peers/fastchat.sh start MODEL_DIR [--port 8200] [--name SERVED_NAME]
#                                      [--timeout 300] [-- EXTRA model_worker ARGS...]
#   benchmarks/peers/fastchat.sh stop   [--port 8200]     (no --port: all started here)
#   benchmarks/peers/fastchat.sh status [--port 8200]
#
# setup: venv .peers/fastchat with fschat==0.2.36, transformers==4.46.3,
#   torch==2.13.0 (CPU wheel) and the worker/server extras it imports.
# start: three processes on loopback: controller (PORT+1), model_worker
#   --device cpu (PORT+2) and the OpenAI-compatible server on PORT; returns once
#   the model is listed at /v1/models.  Logs .peers/logs/fastchat-PORT-*.log,
#   pidfiles .peers/run/fastchat-PORT-*.pid.  The served model name defaults to
#   the folder's name.  FastChat's worker runs one request at a time (no batching).
# All commands are idempotent.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

VENV="$PEERS_DIR/fastchat"
MARKER="$VENV/.parrot-peer-ready"
PKGS=(
    "fschat==0.2.36" "transformers==4.46.3" "torch==2.13.0"
    "accelerate<1.3" "sentencepiece" "protobuf" "safetensors"
    "fastapi" "uvicorn" "shortuuid" "httpx" "requests" "aiohttp" "pydantic>=2,<3"
    "numpy<2.3" "psutil" "tiktoken" "prompt_toolkit" "rich" "nh3" "markdown2"
)

cmd="${1:-}"
[ $# -gt 0 ] && shift
PORT=8200
PORT_SET=0
MODEL=""
NAME=""
TIMEOUT=300
EXTRA=()
while [ $# -gt 0 ]; do
    case "$1" in
        --port) PORT="$2"; PORT_SET=1; shift 2 ;;
        --name) NAME="$2"; shift 2 ;;
        --timeout) TIMEOUT="$2"; shift 2 ;;
        --) shift; EXTRA=("$@"); break ;;
        -*) die "unknown option $1" ;;
        *) [ -z "$MODEL" ] || die "two model folders given"; MODEL="$1"; shift ;;
    esac
done
CTRL_PORT=$((PORT + 1))
WORKER_PORT=$((PORT + 2))
RUN="$PEERS_RUN/fastchat-$PORT"
LOGS="$PEERS_LOGS/fastchat-$PORT"
URL="http://127.0.0.1:$PORT"

setup() {
    if [ -f "$MARKER" ] && "$VENV/bin/python" -c "import fastchat.serve.model_worker" 2>/dev/null; then
        log "fastchat venv ready: $VENV ($(cat "$MARKER"))"
        return 0
    fi
    ensure_venv "$VENV"
    local t0=$SECONDS
    log "pip install ${PKGS[*]} (logs: $PEERS_LOGS/fastchat-setup.log)"
    "$VENV/bin/pip" install "${PKGS[@]}" >>"$PEERS_LOGS/fastchat-setup.log" 2>&1 \
        || { tail -n 30 "$PEERS_LOGS/fastchat-setup.log"; die "pip install failed"; }
    # importing FastChat's servers opens their log files in $LOGDIR (default: the current directory)
    LOGDIR="$PEERS_LOGS" "$VENV/bin/python" -c "import fastchat.serve.model_worker, fastchat.serve.openai_api_server, \
fastchat.serve.controller, transformers, torch; print(transformers.__version__, torch.__version__)" \
        || die "fastchat does not import; see $PEERS_LOGS/fastchat-setup.log"
    echo "fschat==0.2.36 transformers==4.46.3 torch==2.13.0 $(date -Is)" >"$MARKER"
    log "fastchat setup done in $((SECONDS - t0))s"
}

model_listed() {  # the OpenAI server answers and lists at least one model
    curl -sf --noproxy '*' -m 3 "$URL/v1/models" 2>/dev/null | grep -q '"id"'
}

start() {
    [ -n "$MODEL" ] || die "start needs MODEL_DIR (e.g. .peers/models/smollm2)"
    [ -f "$MODEL/config.json" ] || die "$MODEL has no config.json (run convert_smollm2.py)"
    MODEL="$(cd "$MODEL" && pwd)"
    [ -n "$NAME" ] || NAME="$(basename "$MODEL")"
    [ -f "$MARKER" ] || die "run '$0 setup' first"
    if pid_alive "$RUN-api.pid" && model_listed; then
        log "fastchat already running on $URL"
        return 0
    fi
    stop_all_of "$PORT"  # clear half-started leftovers
    mkdir -p "$PEERS_LOGS/fastchat-$PORT.d"
    for p in "$PORT" "$CTRL_PORT" "$WORKER_PORT"; do
        port_in_use "$p" && die "port $p is in use by another process"
    done
    # FastChat writes its own log files to $LOGDIR (default: the current directory).
    local env=(env LOGDIR="$PEERS_LOGS/fastchat-$PORT.d" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
        FASTCHAT_WORKER_API_TIMEOUT=600 PYTHONUNBUFFERED=1)
    local py="$VENV/bin/python" t0=$SECONDS
    log "starting fastchat on $URL: $MODEL as '$NAME' (controller :$CTRL_PORT, worker :$WORKER_PORT)"
    launch "$RUN-controller.pid" "$LOGS-controller.log" "${env[@]}" "$py" -m fastchat.serve.controller \
        --host 127.0.0.1 --port "$CTRL_PORT"
    wait_http "http://127.0.0.1:$CTRL_PORT/test_connection" "$RUN-controller.pid" 60 "$LOGS-controller.log" \
        || curl -s --noproxy '*' -m 2 -o /dev/null -X POST "http://127.0.0.1:$CTRL_PORT/list_models" \
        || { stop_all_of "$PORT"; die "controller did not start"; }
    launch "$RUN-worker.pid" "$LOGS-worker.log" "${env[@]}" "$py" -m fastchat.serve.model_worker \
        --host 127.0.0.1 --port "$WORKER_PORT" --worker-address "http://127.0.0.1:$WORKER_PORT" \
        --controller-address "http://127.0.0.1:$CTRL_PORT" --model-path "$MODEL" \
        --model-names "$NAME" --device cpu "${EXTRA[@]}"
    launch "$RUN-api.pid" "$LOGS-api.log" "${env[@]}" "$py" -m fastchat.serve.openai_api_server \
        --host 127.0.0.1 --port "$PORT" --controller-address "http://127.0.0.1:$CTRL_PORT"
    local start=$SECONDS
    until model_listed; do
        for part in controller worker api; do
            if ! pid_alive "$RUN-$part.pid"; then
                grep -v '| stderr | INFO:' "$LOGS-$part.log" | tail -n 40 >&2
                stop_all_of "$PORT"
                die "fastchat $part exited during start-up"
            fi
        done
        if [ $((SECONDS - start)) -ge "$TIMEOUT" ]; then
            tail -n 20 "$LOGS-worker.log" >&2
            stop_all_of "$PORT"
            die "fastchat did not list a model within ${TIMEOUT}s"
        fi
        sleep 1
    done
    log "fastchat ready on $URL after $((SECONDS - t0))s"
    echo "$URL"
}

stop_all_of() {  # stop_all_of PORT: api, worker, controller of that instance
    local base="$PEERS_RUN/fastchat-$1" part
    for part in api worker controller; do stop_pidfile "$base-$part.pid" 20; done
}

case "$cmd" in
    setup) setup ;;
    start) start ;;
    stop)
        if [ "$PORT_SET" = 1 ]; then
            stop_all_of "$PORT"; log "fastchat on port $PORT stopped"
        else
            for f in "$PEERS_RUN"/fastchat-*-api.pid "$PEERS_RUN"/fastchat-*-worker.pid \
                "$PEERS_RUN"/fastchat-*-controller.pid; do
                [ -e "$f" ] || continue
                stop_pidfile "$f" 20; log "$(basename "$f" .pid) stopped"
            done
        fi ;;
    status)
        if pid_alive "$RUN-api.pid"; then
            if model_listed; then echo "running $URL"; else echo "starting $URL"; fi
        else
            echo "stopped (port $PORT)"; exit 3
        fi ;;
    *) sed -n '2,17p' "$0"; exit 2 ;;
esac
