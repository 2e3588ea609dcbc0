"""The built-in engine.  Torch-free bookkeeping (contexts, request queue) lives
beside the only torch code (model, kv store, runner) so the bookkeeping can be
tested and simulated without a model."""
