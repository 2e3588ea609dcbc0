"""Wire-level vocabulary shared by every layer: errors, sampling settings,
templates, transforms and HTTP schemas.  Imports nothing else of the project
and never torch."""
