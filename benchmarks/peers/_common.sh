# Shared helpers for the peer scripts (sourced, not run).
# Everything lives under $PEERS_DIR (default: <repo>/.peers, which must be git-ignored).

PEERS_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEERS_DIR="${PEERS_DIR:-$PEERS_ROOT/.peers}"
mkdir -p "$PEERS_DIR/logs" "$PEERS_DIR/run"
PEERS_DIR="$(cd "$PEERS_DIR" && pwd)"  # absolute: launch() runs servers from the logs folder
PEERS_LOGS="$PEERS_DIR/logs"
PEERS_RUN="$PEERS_DIR/run"

die() { echo "error: $*" >&2; exit 1; }
log() { echo "[$(date +%H:%M:%S)] $*" >&2; }

# pid_alive PIDFILE -> 0 if the pid in PIDFILE is a live process
pid_alive() {
    local f="$1" pid
    [ -f "$f" ] || return 1
    pid="$(cat "$f" 2>/dev/null)"
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null
}

# launch PIDFILE LOGFILE CMD... : start CMD in its own session (so its children
# share one process group we can stop), output to LOGFILE, pid to PIDFILE.
launch() {
    local pidfile="$1" logfile="$2"
    shift 2
    echo "### $(date -Is) $*" >>"$logfile"
    # Run from the logs folder: FastChat's worker writes model_worker_*.log into its cwd.
    (cd "$PEERS_LOGS" && exec setsid "$@" >>"$logfile" 2>&1 </dev/null) &
    echo $! >"$pidfile"
}

# wait_http URL PIDFILE TIMEOUT_S LOGFILE : poll URL (loopback only) until it answers 200.
wait_http() {
    local url="$1" pidfile="$2" timeout="$3" logfile="$4" start now
    start=$(date +%s)
    while :; do
        if curl -sf --noproxy '*' -m 2 -o /dev/null "$url"; then
            return 0
        fi
        if ! pid_alive "$pidfile"; then
            echo "process exited before $url answered; last log lines:" >&2
            tail -n 40 "$logfile" >&2
            return 1
        fi
        now=$(date +%s)
        if [ $((now - start)) -ge "$timeout" ]; then
            echo "timed out after ${timeout}s waiting for $url; last log lines:" >&2
            tail -n 20 "$logfile" >&2
            return 1
        fi
        sleep 1
    done
}

# stop_pidfile PIDFILE [GRACE_S] : SIGTERM the process group we started, then SIGKILL.
stop_pidfile() {
    local f="$1" grace="${2:-30}" pid i
    [ -f "$f" ] || return 0
    pid="$(cat "$f" 2>/dev/null)"
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
        # launch() used setsid, so pid is its group leader: -pid reaches its workers too.
        kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null
        for ((i = 0; i < grace * 4; i++)); do
            kill -0 -- "-$pid" 2>/dev/null || break
            sleep 0.25
        done
        if kill -0 -- "-$pid" 2>/dev/null; then
            log "pid $pid still alive after ${grace}s; SIGKILL"
            kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null
        fi
    fi
    rm -f "$f"
}

# ensure_venv DIR : create DIR as a venv (python3.11 preferred) if missing.
ensure_venv() {
    local dir="$1" py
    if [ ! -x "$dir/bin/python" ]; then
        py="$(command -v python3.11 || command -v python3)"
        log "creating venv $dir with $py"
        "$py" -m venv "$dir"
    fi
}

# port_in_use PORT -> 0 if something listens on 127.0.0.1:PORT
port_in_use() {
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}
