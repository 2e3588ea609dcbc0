"""The engine's kernel choices as options (parrot.engine.kernels.options): the
``PARROT_*`` environment variables reach them only as the CLI's defaults, a flag
overrides its variable, and an engine built with an option runs what it says."""

from __future__ import annotations

import argparse
import queue
import threading

import pytest

from parrot.engine.config import EngineConfig
from parrot.engine.kernels import bf16_linear, native, prefill_bf16
from parrot.engine.kernels.kernel_set import for_options
from parrot.engine.kernels.options import ENVIRONMENT, KernelOptions, add_kernel_arguments
from parrot.engine.loader import LoadedModel, load_model
from parrot.engine.local import LocalEngine
from parrot.engine.model import LlamaModel
from parrot.engine.runner import EngineRunner


def _parse(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], argv: list[str]) -> KernelOptions:
    for name in ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    add_kernel_arguments(parser)
    return KernelOptions.from_args(parser.parse_args(argv))


def test_without_variables_or_flags_every_kernel_is_on(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _parse(monkeypatch, {}, []) == KernelOptions() == EngineConfig().kernels
    assert KernelOptions() == KernelOptions("native", True, True, True, True, None, True, True)


def test_each_variable_reaches_its_option(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {
        "PARROT_CPU_KERNEL": "portable",
        "PARROT_AMX": "0",
        "PARROT_BF16_LINEAR": "0",
        "PARROT_F32_LINEAR": "0",
        "PARROT_DECODE_FORWARD": "0",
        "PARROT_HUGEPAGES": "0",
        "PARROT_KERNEL_CACHE": "/tmp/parrot-kernels",
        "PARROT_BF16_PREFILL": "0",
    }
    assert _parse(monkeypatch, env, []) == KernelOptions(
        "portable", False, False, False, False, "/tmp/parrot-kernels", False, False
    )
    # the old switch values: 0 is off, 1 the native build; any other value leaves a kernel on
    assert KernelOptions.from_env({"PARROT_CPU_KERNEL": "0"}).cpu_kernel == "off"
    assert KernelOptions.from_env({"PARROT_CPU_KERNEL": "1"}).cpu_kernel == "native"
    assert KernelOptions.from_env({"PARROT_AMX": "yes"}).amx


def test_a_flag_overrides_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"PARROT_AMX": "0", "PARROT_CPU_KERNEL": "off"}
    got = _parse(monkeypatch, env, ["--amx", "--no-c-forward", "--cpu-kernel", "portable"])
    assert got == KernelOptions(cpu_kernel="portable", amx=True, c_forward=False)


def test_unknown_values_are_refused_with_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="cpu_kernel must be one of native, portable, off, not 'fast'"):
        KernelOptions(cpu_kernel="fast")
    with pytest.raises(SystemExit, match="PARROT_CPU_KERNEL: cpu_kernel must be one of"):
        _parse(monkeypatch, {"PARROT_CPU_KERNEL": "fast"}, [])
    with pytest.raises(ValueError, match="cpu_kernel must be one of"):
        native.select("fast")
    assert native.selected() == "native"  # a refused selection changed nothing


def test_the_parrot_cli_builds_its_engine_config_from_the_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    from parrot import cli

    monkeypatch.setenv("PARROT_HUGEPAGES", "0")
    args = cli._parser().parse_args(["engine", "--manager", "http://127.0.0.1:1", "--no-f32-linear"])
    assert KernelOptions.from_args(args) == KernelOptions(f32_linear=False, hugepages=False)


def test_an_engine_runs_the_kernels_its_options_name(tiny_model: LoadedModel) -> None:
    """``cpu_kernel='off'``: no C kernel copy in any projection and the PyTorch step
    strategy; the next engine on the same model with the defaults repacks it with the
    kernels' copies and may take the C forward again."""
    model = LoadedModel(
        "tiny-copy", tiny_model.config, LlamaModel.random_init(tiny_model.config, 1), tiny_model.tokenizer
    )
    qkv = lambda: model.model.model.layers[0].self_attn.qkv  # noqa: E731
    with native.using(native.selected()):  # the runner selects the process's build: restore it
        off = EngineRunner(model, kv_cache_tokens=1024, kernels=KernelOptions(cpu_kernel="off"))
        assert native.selected() == "off" and native.library() is None
        assert off.step_forward.name == "pytorch/packed" and not off.step_forward.c_forward
        assert qkv().f32 is None and qkv().key[0] == "off"
        on = EngineRunner(model, kv_cache_tokens=1024)
        assert native.selected() == "native"
        built = native.library() is not None and bool(native.library().parrot_f32_linear_supported())
        assert (qkv().f32 is not None) == built
        assert on.step_forward.c_forward == built
        same = EngineRunner(model, kv_cache_tokens=1024, kernels=KernelOptions(c_forward=False))
        assert (not same.step_forward.c_forward and same.step_forward.name == "pytorch/fused") or not built


def test_the_kernel_set_names_only_kernels_its_options_allow_and_its_build_has() -> None:
    off = for_options(KernelOptions(cpu_kernel="off"))
    assert off.lib is None and not (off.f32_linear or off.bf16_linear or off.c_attention or off.c_forward)
    assert off.describe() == "C ops build none (switched off (cpu_kernel='off')); kernels: PyTorch only"
    on = for_options()
    lib = native.library("native")
    assert on.lib is lib and on.c_attention == on.c_forward == (lib is not None)
    assert on.f32_linear == (lib is not None and bool(lib.parrot_f32_linear_supported()))
    best = bf16_linear.best(lib)
    assert on.bf16_linear == (None if best == "portable" else best)
    prefill = prefill_bf16.best(32, lib)
    assert on.bf16_prefill == (None if prefill == "portable" else prefill)
    assert not for_options(KernelOptions(bf16_prefill=False)).bf16_prefill
    narrowed = for_options(
        KernelOptions(bf16_linear=False, bf16_prefill=False, f32_linear=False, c_forward=False)
    )
    assert not (narrowed.bf16_linear or narrowed.bf16_prefill or narrowed.f32_linear or narrowed.c_forward)
    assert narrowed.c_attention == on.c_attention
    no_tiles = for_options(KernelOptions(amx=False))  # the bf16 kernels keep AVX-512 BF16
    assert no_tiles.bf16_linear in (None, "avx512-bf16") and no_tiles.bf16_prefill in (None, "avx512-bf16")
    portable = for_options(KernelOptions(cpu_kernel="portable"))  # no AVX-512 / AMX code in it
    assert not (portable.f32_linear or portable.bf16_linear or portable.bf16_prefill)
    assert portable.describe().startswith("C ops build portable") or portable.lib is None


def test_each_thread_has_its_own_selection_and_others_get_the_latest() -> None:
    seen: dict[str, str] = {}

    def engine_thread(mode: str) -> None:
        native.select(mode)
        seen[mode] = native.selected()

    mine = native.selected()
    with native.using(mine):  # leave the process's selection as it was
        for mode in ("portable", "off"):
            t = threading.Thread(target=engine_thread, args=(mode,))
            t.start()
            t.join()
        assert seen == {"portable": "portable", "off": "off"}
        bystander: list[str] = []
        t = threading.Thread(target=lambda: bystander.append(native.selected()))
        t.start()
        t.join()
        assert bystander == ["off"]  # a thread that never selected: the latest selection
        with native.using("portable"):
            assert native.selected() == "portable" and native.library() is native.library("portable")
        assert native.selected() == mine  # this thread's own, restored


def test_two_engines_of_one_process_each_run_their_own_build() -> None:
    """Each engine selects its build on its own worker thread, where its steps run: the
    attention and fused ops inside one engine's forward find that engine's build, not
    the build of the engine started last."""
    modes = ("portable", "off")
    engines = [
        LocalEngine(load_model("tiny"), kernels=KernelOptions(cpu_kernel=mode), latency_probe=False)
        for mode in modes
    ]
    try:
        for engine, mode in zip(engines, modes, strict=True):
            answers: queue.Queue = queue.Queue()
            engine.runner.call(
                lambda: (native.selected(), native.library()),
                lambda got, err, answers=answers: answers.put((got, err)),
            )
            (selected, lib), err = answers.get(timeout=60)
            assert err is None and selected == mode
            assert (lib is None) == (mode == "off")
    finally:
        for engine in engines:
            engine.close()
