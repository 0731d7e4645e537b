"""`ssdlocal serve`: an OpenAI-compatible HTTP server over one Engine.

app.py (routes, streaming, errors), protocol.py (request validation, error body),
limits.py (request limits, reading bodies), connections.py (connection limit and
deadlines on uvicorn's protocol), responses.py (response and chunk bodies), scheduler.py
(the engine thread: batching, parts, per-request queues, cancellation), metrics.py
(Prometheus text), run.py (socket, uvicorn, signals). Imports the engine and core; the
engine never imports the server.
"""
