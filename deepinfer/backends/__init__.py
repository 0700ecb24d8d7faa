"""Built-in backends. Each registers through the `deepinfer.backends` entry-point group."""
