"""The manager's HTTP application: the FastAPI app (:mod:`.app`), one router per resource
(sessions and batches, engines, metrics, the session page).  Routers parse, authorize,
call :class:`~parrot.manager.service.Manager` methods only, and serialise."""
