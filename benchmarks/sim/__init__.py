"""The evaluation suite in simulation: Parrot's real manager over simulated engines
(:mod:`parrot.sim`), in virtual time.  ``python -m benchmarks.sim --help``."""
