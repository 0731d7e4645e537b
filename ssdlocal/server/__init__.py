"""`ssdlocal serve`: an OpenAI-compatible HTTP server over one Engine.

app.py (routes, streaming, errors), protocol.py (request validation, error body),
responses.py (response and chunk bodies), scheduler.py (the engine thread: batching,
per-request queues, cancellation), metrics.py (Prometheus text), run.py (socket and
uvicorn). Imports the engine and core; the engine never imports the server.
"""
