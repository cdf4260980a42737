"""The HTTP server: OpenAI-style asynchronous /v1/videos jobs in front of one Engine.

app.py builds the FastAPI app (and `serve()`, the CLI entry); routes.py the handlers; schemas.py the pydantic
boundary; jobs.py the typed Job and its SQLite store; runner.py feeds stored jobs to the engine; uploads.py
streams request bodies under byte limits; input_paths.py guards server-side paths; artifacts.py names files;
metrics.py writes Prometheus text; errors.py shapes errors; settings.py holds the server flags.
"""
