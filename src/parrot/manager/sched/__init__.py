"""Scheduling: the paper's Algorithm 1 (:mod:`.scheduler`, its vocabulary in
:mod:`.scheduler_types`, each policy's decisions in :mod:`.policies`, the engines'
working copies in :mod:`.engine_index`), the order queued calls are considered in
(:mod:`.queue_order`), what each engine holds (:mod:`.engine_loads`) and saturation
batching (:mod:`.saturation`).  Imports :mod:`parrot.manager.dag` and
:mod:`parrot.manager.backends`, never the core above it."""
