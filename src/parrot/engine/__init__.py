"""The built-in engine.  Its torch-free bookkeeping (contexts, the block pool, the
prefix cache, the step planner, the latency fit) is the :mod:`parrot.engine.core`
package, which the simulator and the manager import too; the rest (model, KV
store, kernels, runner) is the torch code, so the bookkeeping can be tested and
simulated without a model."""
