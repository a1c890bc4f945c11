"""Sandbox backends: one module per container engine behind ``base.SandboxBackend``."""

from service.sandbox.base import ExitStatus, OutputSink, SandboxBackend, SandboxHandle, SandboxSpec

__all__ = ["ExitStatus", "OutputSink", "SandboxBackend", "SandboxHandle", "SandboxSpec"]
