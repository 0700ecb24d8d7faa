"""User-facing entry points: the `deepinfer` CLI and the OpenAI-compatible server.

They use only the public API (see docs/architecture.md, "Import rules"), so
they keep working whatever the engine's internals become.
"""
