"""Server-test fixtures (the helpers live in server_harness.py, a uniquely named module)."""

from server_harness import tiny_checkpoint  # noqa: F401  (session fixture: one tiny checkpoint for all server tests)
