"""Scheduling: the paper's Algorithm 1 (:mod:`.scheduler`, its vocabulary in
:mod:`.scheduler_types`), the order queued calls are considered in (:mod:`.queue_order`),
what each engine holds (:mod:`.engine_loads`) and saturation batching
(:mod:`.saturation`).  Imports :mod:`parrot.manager.dag` and
:mod:`parrot.manager.backends`, never the core above it."""
