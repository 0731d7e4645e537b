"""Asynchronous SSD drafting: the worker process that owns the draft model and the
speculation cache, the client the engine drives, and the typed messages between them."""
