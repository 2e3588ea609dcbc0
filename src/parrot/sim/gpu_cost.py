"""Step costs of GPU engines from published figures: the paper's LLaMA-7B on an A6000
(figs. 17, 19), LLaMA-13B on an A100-80GB (figs. 11-14, 18) and LLaMA-7B on an A100
(figs. 15, 16), served vLLM-style in fp16.

A decode step streams the weights once and the KV its sequences read; a prefill
chunk is compute-bound.  In :class:`~parrot.sim.cost.StepCost`'s terms::

    base              = weight_bytes / (bandwidth * weight_bw_eff) + step_overhead_s
    per_kv_token      = kv_bytes_per_token / (bandwidth * kv_bw_eff)
    per_prefill_token = 2 * params / (fp16_tensor_peak * flop_util)
    per_decode_seq    = 2 * params / (fp16_tensor_peak * flop_util)
    per_prefill_pair  = 4 * layers * hidden / (fp16_tensor_peak * flop_util)

``kv_bytes_per_token = 2 (K and V) * layers * hidden * 2 bytes``.  The hardware and
model figures are published (sources beside each); the efficiencies and the step
overhead are assumptions (:data:`VLLM_ON_AMPERE`), set so that LLaMA-13B on an A100
gives the per-output-token latencies the paper's artifact reports (about 23-26 ms at
<= 2k tokens in flight, 33-37 ms at 12k; ``tests/test_sim_cost.py`` fails if it does
not) and used unchanged for the A6000.  The KV cache an engine holds is what the
GPU's memory keeps after the weights at vLLM's default memory utilisation.
"""

from __future__ import annotations

from dataclasses import dataclass

from parrot.sim.cost import CostProfile, StepCost

__all__ = [
    "A100_80GB_SXM",
    "A6000",
    "LLAMA7B_A100",
    "LLAMA7B_A6000",
    "LLAMA13B_A100",
    "VLLM_ON_AMPERE",
    "gpu_profile",
]


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: float
    bandwidth: float  # bytes/s
    fp16_tensor_flops: float  # dense (no structured sparsity), FLOP/s


@dataclass(frozen=True)
class Model:
    name: str
    params: float
    layers: int
    hidden: int
    bytes_per_param: int = 2  # fp16

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.hidden * self.bytes_per_param


@dataclass(frozen=True)
class Serving:
    """How well the serving stack uses the hardware (assumptions, not measurements)."""

    weight_bw_eff: float  # fraction of peak bandwidth streaming the weights (large GEMVs)
    kv_bw_eff: float  # fraction of peak bandwidth of the paged-attention kernel reading KV
    flop_util: float  # fraction of the fp16 tensor peak of prefill GEMMs
    step_overhead_s: float  # per step: kernel launches, scheduling, sampling (Python-side)
    memory_util: float  # fraction of GPU memory the engine may use (weights + KV)


# NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web,
# 2021), column "A100 80GB SXM": GPU memory 80 GB HBM2e, bandwidth 2,039 GB/s, FP16 Tensor
# Core 312 TFLOPS (624 with sparsity).  (The PCIe card: 1,935 GB/s, same peak.)
A100_80GB_SXM = Gpu("A100-80GB-SXM", memory_bytes=80e9, bandwidth=2039e9, fp16_tensor_flops=312e12)

# NVIDIA RTX A6000 datasheet (nvidia-rtx-a6000-datasheet, 2020): 48 GB GDDR6, 768 GB/s;
# its "Tensor performance 309.7 TFLOPS" is with structured sparsity; dense FP16 tensor
# (FP32 accumulate) is half, 154.8 TFLOPS (NVIDIA Ampere GA102 GPU architecture
# whitepaper, appendix table for the RTX A6000).  38.7 TFLOPS is its non-tensor FP32/FP16.
A6000 = Gpu("RTX-A6000", memory_bytes=48e9, bandwidth=768e9, fp16_tensor_flops=154.8e12)

# LLaMA: Touvron et al., "LLaMA: Open and Efficient Foundation Language Models" (2023),
# table 2: 6.7B params, dimension 4096, 32 layers; 13.0B params, dimension 5120, 40 layers.
LLAMA_7B = Model("LLaMA-7B", params=6.7e9, layers=32, hidden=4096)
LLAMA_13B = Model("LLaMA-13B", params=13.0e9, layers=40, hidden=5120)

VLLM_ON_AMPERE = Serving(
    weight_bw_eff=0.80,  # assumption: large fp16 GEMVs reach ~80% of peak DRAM bandwidth
    kv_bw_eff=0.40,  # assumption: fitted to the artifact's 2k -> 12k slope (25 -> 35 ms)
    flop_util=0.50,  # assumption: prefill GEMMs at half the tensor peak
    step_overhead_s=0.0067,  # assumption: fitted to the artifact's <= 2k latency (23-26 ms)
    memory_util=0.90,  # vLLM's default gpu_memory_utilization (vLLM engine arguments docs)
)


def gpu_cost(model: Model, gpu: Gpu, serving: Serving = VLLM_ON_AMPERE) -> StepCost:
    """The step cost of ``model`` on one ``gpu`` (see the module docstring)."""
    flops = gpu.fp16_tensor_flops * serving.flop_util
    return StepCost(
        base=model.weight_bytes / (gpu.bandwidth * serving.weight_bw_eff) + serving.step_overhead_s,
        per_prefill_token=2 * model.params / flops,
        per_decode_seq=2 * model.params / flops,
        per_kv_token=model.kv_bytes_per_token / (gpu.bandwidth * serving.kv_bw_eff),
        per_prefill_pair=4 * model.layers * model.hidden / flops,
    )


def kv_cache_tokens(model: Model, gpu: Gpu, serving: Serving = VLLM_ON_AMPERE) -> int:
    """KV tokens the GPU's memory holds after the weights (activations neglected)."""
    free = gpu.memory_bytes * serving.memory_util - model.weight_bytes
    if free <= 0:
        raise ValueError(f"{model.name} does not fit on {gpu.name}")
    return int(free // model.kv_bytes_per_token)


def gpu_profile(name: str, model: Model, gpu: Gpu, serving: Serving = VLLM_ON_AMPERE) -> CostProfile:
    meta = {"model": model.name, "gpu": gpu.name, "source": "published figures (parrot.sim.gpu_cost)"}
    return CostProfile(name, gpu_cost(model, gpu, serving), kv_cache_tokens(model, gpu, serving), meta)


LLAMA7B_A6000 = gpu_profile("llama7b-a6000", LLAMA_7B, A6000)
LLAMA13B_A100 = gpu_profile("llama13b-a100", LLAMA_13B, A100_80GB_SXM)
LLAMA7B_A100 = gpu_profile("llama7b-a100", LLAMA_7B, A100_80GB_SXM)  # fig. 15/16's Bing Copilot
