"""The OpenAI-compatible HTTP server (needs the `serve` extra: fastapi, uvicorn, pydantic, prometheus-client).

Nothing here is imported by `import deepinfer`; `deepinfer serve` imports server.run_server lazily.
"""
