"""oneDNN-packed projections: same results as the plain model (up to fp32 rounding),
idempotent, and skipped where they cannot apply."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from parrot.engine.config import EngineConfig
from parrot.engine.device import placement
from parrot.engine.kernels import packed_linear
from parrot.engine.kernels.packed_linear import (
    PackedLinear,
    Projection,
    packed_linear_available,
    prepack_linears,
)
from parrot.engine.model import LlamaModel, ModelConfig
from tests.cpu_features import needs_bf16_packing

pytestmark = pytest.mark.skipif(
    not packed_linear_available(torch.empty(2, 2)), reason="this torch build has no oneDNN CPU ops"
)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("rows", [1, 5, 16, 200])
def test_packed_linear_matches_plain(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    lin = nn.Linear(48, 80, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(80, 48, generator=gen))
        lin.bias.copy_(torch.randn(80, generator=gen))
    x = torch.randn(rows, 48, generator=gen)
    with torch.no_grad():
        exact = x.double() @ lin.weight.double().T + lin.bias.double()
        packed = PackedLinear(lin.weight, lin.bias)(x)
    assert packed.shape == (rows, 80) and packed.dtype == torch.float32
    assert rel_err(packed, exact) < 1e-6
    with pytest.raises(ValueError, match="expected last dim 48"):
        PackedLinear(lin.weight)(torch.randn(2, 47))


def test_prepacked_model_gives_the_plain_models_logits_and_greedy_tokens() -> None:
    config = ModelConfig.tiny()
    plain = LlamaModel.random_init(config, 3)
    packed = LlamaModel.random_init(config, 3)
    assert packed.prepack() is True and packed.prepack() is True  # idempotent
    layers = packed.model.layers
    alone = [m for layer in layers for m in (layer.self_attn.o_proj, layer.mlp.down_proj)]
    assert all(isinstance(m.packed, PackedLinear) for m in alone)
    fused_parts = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        fused_parts += [attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj]
    assert fused_parts and not any(m.packed is not None for m in fused_parts)  # no second copy
    assert all(layer.self_attn.qkv is not None and layer.mlp.gate_up is not None for layer in layers)

    ids = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(40)
    with torch.no_grad():
        a = plain.compute_logits(plain(ids, pos, _Causal()))
        b = packed.compute_logits(packed(ids, pos, _Causal()))
    assert rel_err(b, a) < 1e-5
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    # the checkpoint is untouched: same parameters, nothing packed in the state dict
    assert plain.state_dict().keys() == packed.state_dict().keys()
    for k, v in plain.state_dict().items():
        assert torch.equal(v, packed.state_dict()[k])


def test_prepack_is_skipped_where_it_cannot_apply() -> None:
    model = LlamaModel.random_init(ModelConfig.tiny(), 0).double()
    assert model.prepack() is False
    assert not any(isinstance(m, Projection) and m.packed is not None for m in model.modules())
    assert not packed_linear_available(torch.empty(2, 2, dtype=torch.float64))
    assert not packed_linear_available(torch.empty(2, 2, 2))


@needs_bf16_packing
def test_bf16_packed_weights_keep_fp32_activations() -> None:
    gen = torch.Generator().manual_seed(5)
    weight, x = torch.randn(64, 32, generator=gen), torch.randn(7, 32, generator=gen)
    with torch.no_grad():
        exact = x.double() @ weight.double().T
        got = PackedLinear(weight, dtype=torch.bfloat16)(x)
    assert got.dtype == torch.float32
    assert 1e-5 < rel_err(got, exact) < 2e-2  # bf16 rounding: visible, and small
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        PackedLinear(weight, dtype=torch.float16)


@needs_bf16_packing
def test_a_model_repacks_when_asked_for_another_dtype() -> None:
    model = LlamaModel.random_init(ModelConfig.tiny(), 1)
    assert model.prepack() and model.prepack(torch.bfloat16)
    packed = [m.packed for m in model.modules() if isinstance(m, Projection) and m.packed is not None]
    packed += [f for layer in model.model.layers for f in (layer.self_attn.qkv, layer.mlp.gate_up)]
    assert {p.dtype for p in packed} == {torch.bfloat16}
    assert model._packed_logits is not None and model._packed_logits.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the checkpoint is untouched
    model.prepack(torch.float32)
    packed = [m.packed for m in model.modules() if isinstance(m, Projection) and m.packed is not None]
    packed += [f for layer in model.model.layers for f in (layer.self_attn.qkv, layer.mlp.gate_up)]
    assert {p.dtype for p in packed} == {torch.float32}


def test_prepack_linears_leaves_the_excluded_unpacked_and_drops_their_copies() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Projection(8, 8), Projection(8, 4), nn.Linear(4, 2))
    x = torch.randn(3, 8)
    with torch.no_grad():
        expected = model(x)
        assert prepack_linears(model) == 2  # a plain nn.Linear is left alone
        assert prepack_linears(model, exclude=[model[0]]) == 1
        assert model[0].packed is None
        assert isinstance(model[1].packed, PackedLinear)
        assert rel_err(model(x), expected) < 1e-5


class _Causal:  # causal attention over the whole sequence: enough to compare two models
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        out = nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
        )
        return out.transpose(0, 1)


@pytest.mark.parametrize("bias", [False, True])
def test_fused_qkv_and_gate_up_match_the_separate_projections(bias: bool) -> None:
    config = ModelConfig.tiny().replace(attention_bias=bias)
    plain, packed = LlamaModel.random_init(config, 4), LlamaModel.random_init(config, 4)
    if bias:  # random_init may leave biases at zero; make them matter
        for a, b in zip(plain.modules(), packed.modules(), strict=True):
            if isinstance(a, nn.Linear) and a.bias is not None:
                with torch.no_grad():
                    a.bias.normal_(generator=torch.Generator().manual_seed(1))
                    b.bias.copy_(a.bias)
    assert packed.prepack()
    ids = torch.randint(0, config.vocab_size, (24,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a = plain.compute_logits(plain(ids, torch.arange(24), _Causal()))
        b = packed.compute_logits(packed(ids, torch.arange(24), _Causal()))
    assert rel_err(b, a) < 1e-5 and torch.equal(a.argmax(-1), b.argmax(-1))


@needs_bf16_packing
def test_bf16_packed_model_keeps_an_fp32_residual_stream() -> None:
    config = ModelConfig.tiny()
    plain, packed = LlamaModel.random_init(config, 6), LlamaModel.random_init(config, 6)
    assert packed.prepack(torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (24,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        exact = plain(ids, torch.arange(24), _Causal())
        hidden = packed(ids, torch.arange(24), _Causal())
        logits = packed.compute_logits(hidden)
    assert hidden.dtype == torch.float32 and logits.dtype == torch.float32
    assert 1e-5 < rel_err(hidden, exact) < 5e-2  # bf16 rounding: visible, and small
    assert not torch.isnan(logits).any()


def test_the_bf16_probe_answers_as_onednn_does() -> None:
    """bf16 packing needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT: the probe says whether
    oneDNN packs bf16 here, and bf16 is offered only then (an AVX2-only CPU raises)."""
    w = torch.randn(32, 48)
    if packed_linear.bf16_packing_supported():
        assert packed_linear_available(w, torch.bfloat16)
        assert PackedLinear(w, dtype=torch.bfloat16).dtype == torch.bfloat16
    else:
        assert not packed_linear_available(w, torch.bfloat16)
        with pytest.raises(RuntimeError, match="bf16"):
            torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16), 16)
    assert packed_linear_available(w)  # fp32 packs on every CPU with oneDNN


def test_bf16_weights_on_a_cpu_without_bf16_packing_are_refused_before_a_model_loads(monkeypatch) -> None:
    monkeypatch.setattr(packed_linear, "bf16_packing_supported", lambda: False)
    with pytest.raises(ValueError, match=r"--weight-dtype bfloat16 needs a CPU .* leave --weight-dtype out"):
        placement(EngineConfig(weight_dtype=torch.bfloat16))
    assert placement(EngineConfig()).prepack  # fp32 weights still pack
    model = LlamaModel.random_init(ModelConfig.tiny(), seed=0)
    assert not model.prepack(torch.bfloat16)  # the library path declines rather than crashing
    assert prepack_linears(model, torch.bfloat16) == 0
