"""The engine's torch-free core: the bookkeeping the built-in engine, the simulator
(:mod:`parrot.sim`) and the manager share.

- :mod:`~parrot.engine.core.block_pool`: the paged KV memory's blocks (reference counts,
  the prefix cache's released blocks);
- :mod:`~parrot.engine.core.contexts`: contexts (token ids, block tables, forks);
- :mod:`~parrot.engine.core.prefix_cache`: the block digest chain of automatic prefix caching;
- :mod:`~parrot.engine.core.memory`: which idle context's KV to evict;
- :mod:`~parrot.engine.core.jobs`, :mod:`~parrot.engine.core.stopping`: requests and their ends;
- :mod:`~parrot.engine.core.step_planner`: admission, each step's plan and KV reservation;
- :mod:`~parrot.engine.core.step_work`, :mod:`~parrot.engine.core.prefix_tree`: what a step
  computes and reads;
- :mod:`~parrot.engine.core.latency_fit`: decode step time against token load, and the
  latency cap that follows.

Invariant (checked by ``tests/test_import_contracts.py``): nothing here imports torch
(other than for type annotations), numpy or triton, nor any of :mod:`parrot` but
:mod:`parrot.protocol` and this package.
"""
