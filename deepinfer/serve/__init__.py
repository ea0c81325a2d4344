"""OpenAI-compatible HTTP server: `python -m deepinfer.serve --help`."""
