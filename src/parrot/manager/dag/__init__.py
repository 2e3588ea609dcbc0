"""The dataflow graph: sessions, variables and calls (:mod:`.graph`), prompts rendered
and tokenized (:mod:`.render`, :mod:`.tokens`), prefix keys (:mod:`.prefix`,
:mod:`.shared_start`) and the objectives deduced from the graph (:mod:`.objectives`,
:mod:`.objective_cache`).  Imports nothing of the manager outside this package."""
