"""The kernels the engine's model runs on, behind one interface.

:func:`~parrot.engine.kernels.kernel_set.for_options` turns an engine's
:class:`~parrot.engine.kernels.options.KernelOptions` and what this CPU and build
offer into a :class:`~parrot.engine.kernels.kernel_set.KernelSet`, once, when the
engine starts: which linear kernel its projections use at decode sizes, whether
decode attention runs on the C kernels and whether a decode step may run all layers
in one C call.  The step strategy (:mod:`parrot.engine.step_forward`) and the
weight packing (:meth:`~parrot.engine.model.LlamaModel.prepack`) read the set;
nothing below them chooses again.  A strategy for another device adds its kernels
here and one more strategy, not another fallback.

Modules: ``options`` (the choices, torch-free; the ``PARROT_*`` defaults of the CLI),
``kernel_set`` (the interface), ``native`` (the C ops' build and loading; ``csrc/``
holds the sources and ``csrc/parrot_ops.h``, the one declaration of the C
boundary, from which ``c_boundary`` derives the ctypes side; ``openmp_runtime``
finds the OpenMP runtime to link), ``packed_linear`` (oneDNN-packed projections
that hold the C linear kernels' copies: ``f32_linear``, ``bf16_linear``, with
``linear_args``' shared checks), ``fused`` (a layer's elementwise steps in C),
``decode_forward`` (a decode step's layers in one C call) and ``attention/`` (paged
decode attention: PyTorch, C, Triton).

This ``__init__`` imports nothing, so ``options`` stays importable without torch.
"""
