"""Marks for tests that need a CPU feature some of the project's machines lack.

oneDNN packs bf16 weights only with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT: the
2-core Xeon (AMX) and the Zen 4 EPYC have them, an AVX2-only EPYC (Milan) does not.
There, ``--weight-dtype bfloat16`` is refused at start-up (tested in
``tests/test_packed_linear.py`` on every machine), and the tests of what bf16 weights
compute cannot run.
"""

from __future__ import annotations

import pytest
import torch

from parrot.engine.kernels.packed_linear import bf16_packing_supported

needs_bf16_packing = pytest.mark.skipif(
    not bf16_packing_supported(),
    reason=f"oneDNN packs bf16 weights only with AVX-512 or AVX-NE-CONVERT; this CPU offers "
    f"{torch.backends.cpu.get_cpu_capability()}",
)


def bf16_weights(*rest: object) -> object:
    """A parameter (``torch.bfloat16``, then ``rest``) for bf16 weights, skipped where they cannot pack."""
    return pytest.param(torch.bfloat16, *rest, marks=needs_bf16_packing)
