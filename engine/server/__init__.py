"""kvpilot's OpenAI-compatible HTTP server over the engine (`kvpilot serve`).

Nothing is imported here: `kvpilot.engine.server.cli` must load without fastapi."""
