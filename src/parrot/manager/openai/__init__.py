"""The OpenAI-compatible front door: ``/v1/completions``, ``/v1/models``
(:mod:`.completions`) and ``/v1/chat/completions`` (:mod:`.chat`), each request run as
an internal session's calls (:mod:`.response`).  Its routers call only
:class:`~parrot.manager.service.Manager` methods.

(Absolute imports throughout: inside this package ``import openai`` still names the
PyPI client, never this package.)"""
