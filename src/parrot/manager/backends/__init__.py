"""What the manager runs calls on: the engine pool (:mod:`.pool`), Parrot's engines over
HTTP (:mod:`.remote_engine`) and external OpenAI-compatible servers such as vLLM and
SGLang (:mod:`.openai_backend`, set up by :mod:`.connect`).  Imports only
:mod:`parrot.protocol` (and :mod:`parrot.engine.core`'s latency fit)."""
