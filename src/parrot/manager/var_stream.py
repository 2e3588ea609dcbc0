"""A variable's value as a stream of events, for clients that read text as it is made.

:func:`variable_events` turns a variable's changes into events (the transport,
e.g. NDJSON lines over HTTP, is the caller's):

* ``{"text": delta}`` for each piece of text its producer generated, in order;
* ``{"restart": True}`` when the producer is re-run (its engine failed and the
  call went to another one): the text sent so far is void, the deltas start over;
* last, ``{"done": True, "state", "value", "error"}``: ``state`` is ``"ready"`` or
  ``"failed"``, ``value`` the whole value (None if failed), ``error`` the error's
  code, message and detail (None if ready).

A variable without a producer (set by the client) yields its whole value as one
``text`` event before ``done``.  The events end with exactly one ``done``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from parrot.manager.dag.graph import Variable
from parrot.manager.views import error_info

WAIT_SLICE_S = 30.0
"""How long one wait for a change lasts before the variable is looked at again."""


async def variable_events(var: Variable) -> AsyncIterator[dict[str, Any]]:
    """The events of ``var`` from now until it is ready or failed (see the module)."""
    sent = 0
    while True:
        if var.producer is not None:
            if sent > len(var.partial):  # the producer is being re-run on another engine
                yield {"restart": True}
                sent = 0
            while sent < len(var.partial):
                yield {"text": var.partial[sent]}
                sent += 1
        if var.state != "pending":
            if var.producer is None and var.state == "ready":
                yield {"text": var.value}
            err = error_info(var.error)
            yield {
                "done": True,
                "state": var.state,
                "value": var.value,
                "error": err.model_dump() if err else None,
            }
            return
        await var.wait_change(WAIT_SLICE_S)
