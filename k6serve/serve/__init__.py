"""The HTTP server: OpenAI-style asynchronous /v1/videos jobs in front of one Engine.

app.py builds the FastAPI app, with middleware.py's ASGI middlewares; server_process.py runs it (`serve()`, the CLI
entry); routes.py gathers the handlers, one module per resource (video_routes.py, with video_creation.py and
video_file_response.py; lora_routes.py; memory_routes.py; status_routes.py), which read server_context.py's
ServerContext; expiry.py deletes expired jobs; the pydantic boundary: what clients send in video_create_body.py
(POST /v1/videos) and control_bodies.py (LoRA and memory), validated by body_parsing.py and documented by
body_documentation.py, and what the server answers in response_models.py; jobs.py the typed Job and its SQLite
store; runner.py feeds stored jobs to the engine, job_outcomes.py records how each ended, runner_refusals.py holds what
the runner refuses; webhook_sender.py delivers the jobs' webhook events (webhook_transport.py signs and POSTs one,
webhook_urls.py checks and shows the URLs, webhook_outbox.py keeps the events in the job store); uploads.py streams
request bodies under byte limits; input_paths.py guards server-side paths; artifacts.py names files; metrics.py writes
Prometheus text; errors.py shapes errors; settings.py holds the server flags.
"""
