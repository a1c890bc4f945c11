"""In-container runtime of ptc-sandbox (standard library only).

It runs one script per sandbox (``python3 -m ptc_runtime``) and gives the
generated ``tools`` package its client for the broker's unix socket. Nothing
here is trusted by the service: the container is the trust boundary, and the
broker outside it is the only authority on which tool calls happened.
"""

from ptc_runtime.client import ToolError

__all__ = ["ToolError"]
