"""Parrot's real manager on simulated engines, in virtual time.

The manager (graph, deduction, prefix index, scheduler, executor) runs unchanged
on :class:`~parrot.sim.clock.VirtualTimeLoop`, whose clock jumps to the next
timer instead of waiting; engines are :class:`~parrot.sim.engine.SimEngine`,
which plan their steps with the real engine's torch-free planner
(:class:`~parrot.engine.core.step_planner.StepPlanner`: admission, prefix-cache hits,
KV reservation, preemption) and take the time a :class:`~parrot.sim.cost.StepCost`
model gives each step instead of running a model.  A run is deterministic for a
seed and takes seconds of wall time whatever its virtual length.
"""
