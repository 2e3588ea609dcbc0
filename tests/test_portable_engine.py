"""An engine generation on the portable build of the C ops (no AVX-512/AMX code), the
build CPUs without AVX-512 run: it runs everywhere, so this check never skips (issue 41)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from parrot.engine.kernels import kernel_set, native
from parrot.engine.kernels.options import KernelOptions
from parrot.engine.loader import LoadedModel, load_model
from parrot.engine.local import LocalEngine
from parrot.protocol.sampling import SamplingParams
from parrot.protocol.schemas import TokenLogprob

PROMPT = list(range(3, 60))


@pytest.fixture
def restore_native_build() -> Iterator[None]:
    """An engine makes its build of the C ops the process's (native.select): the native
    build again afterwards, for the tests that follow."""
    yield
    kernel_set.for_options().select()


def _generate(loaded: LoadedModel, cpu_kernel: str) -> tuple[list[int], list[TokenLogprob], str, Any]:
    """Greedy tokens (with their logprobs) of one generation on an engine over ``loaded`` with
    the ``cpu_kernel`` build, its decode path and the build it loaded."""
    engine = LocalEngine(loaded, kernels=KernelOptions(cpu_kernel=cpu_kernel), latency_cap=4096)
    try:

        async def run() -> tuple[list[int], list[TokenLogprob]]:
            await engine.fill(PROMPT, 1)
            sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
            ids: list[int] = []
            lps: list[TokenLogprob] = []
            async for chunk in engine.generate(sp, 1):
                ids += chunk.token_ids
                lps += chunk.logprobs or []
            await engine.free_context(1)
            return ids, lps

        ids, lps = asyncio.run(run())
        stats = asyncio.run(engine.stats())
        assert stats.num_contexts == 0 and stats.generated_tokens == 12
        return ids, lps, stats.decode_path, engine.runner.kernels.lib
    finally:
        engine.close()


def test_one_generation_on_the_portable_build(restore_native_build: None) -> None:
    portable = native.library("portable")
    assert portable is not None, "the portable build must compile wherever the tests run"
    ids, lps, path, lib = _generate(load_model("tiny"), "portable")  # a model of its own: packing changes it
    assert lib is portable and path
    reference, ref_lps, ref_path, ref_lib = _generate(load_model("tiny"), "off")  # PyTorch alone
    assert ref_lib is None and ref_path.startswith("pytorch")
    # greedy: the same tokens (the reference's top two differ by 1e-3 or more in logprob at
    # every step of this prompt, far above the builds' rounding differences)
    assert len(ids) == 12 and ids == reference
    assert [lp.logprob for lp in lps] == pytest.approx([lp.logprob for lp in ref_lps], abs=1e-3)
