"""The peer-server harness in ``benchmarks/peers/``: scripts parse, the model
export writes a folder that vLLM/FastChat (transformers 4.46) accept and that
Parrot loads back identically.  Starts no server and installs nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / "benchmarks" / "peers"


@pytest.mark.parametrize("script", ["vllm_cpu.sh", "fastchat.sh", "_common.sh"])
def test_scripts_parse(script: str) -> None:
    subprocess.run(["bash", "-n", str(PEERS / script)], check=True)


@pytest.mark.parametrize("script", ["vllm_cpu.sh", "fastchat.sh"])
def test_usage_and_status_of_a_stopped_peer(script: str, tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "PEERS_DIR": str(tmp_path)}
    usage = subprocess.run(["bash", str(PEERS / script)], capture_output=True, text=True, env=env)
    assert usage.returncode == 2
    assert "setup" in usage.stdout and "start" in usage.stdout
    status = subprocess.run(
        ["bash", str(PEERS / script), "status", "--port", "1"], capture_output=True, text=True, env=env
    )
    assert status.returncode == 3
    assert status.stdout.startswith("stopped")
    stop = subprocess.run(["bash", str(PEERS / script), "stop"], capture_output=True, text=True, env=env)
    assert stop.returncode == 0  # nothing to stop is fine


def test_tiny_export_is_a_complete_hf_folder(tmp_path: Path) -> None:
    from safetensors import safe_open

    from parrot.engine.loader import load_hf_dir
    from parrot.protocol.tokenizer import TextTokenizer

    out = tmp_path / "tiny"
    cmd = [sys.executable, str(PEERS / "convert_smollm2.py"), "--tiny", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["torch_dtype"] == "float32" and "rope_theta" in cfg
    assert cfg["head_dim"] >= 32  # vLLM's CPU attention supports no smaller head
    tc = json.loads((out / "tokenizer_config.json").read_text())
    assert tc["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert "<|im_start|>" in tc["chat_template"]
    assert tc["eos_token"] and tc["pad_token"]
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}  # transformers 4.46 requires it

    loaded = load_hf_dir(out)
    assert loaded.config.head_dim == cfg["head_dim"]
    tiny = TextTokenizer.byte_level_tiny()
    assert loaded.tokenizer.encode("héllo {{x}}") == tiny.encode("héllo {{x}}")
    assert loaded.tokenizer.eos_token_ids == tiny.eos_token_ids

    again = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
    assert "already exported" in again.stdout  # idempotent


def test_peers_module_validates_arguments() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import peers
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    with pytest.raises(ValueError, match="unknown peer"):
        peers.start_peer("nope", "/x", 1)
    with pytest.raises(ValueError, match="vLLM options"):
        peers.start_peer("fastchat", "/x", 1, prefix_caching=True)
    with pytest.raises(ValueError):
        peers.ensure_model("gpt2")
