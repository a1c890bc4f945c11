"""ptc-sandbox: run model-written Python scripts whose ``tools`` stubs call real tool endpoints."""

__version__ = "0.1.0"
