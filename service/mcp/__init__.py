"""MCP: the service as an MCP server (docs/mcp.md), over Streamable HTTP and over stdio.

==========  ========================================================================================================
module      owns
==========  ========================================================================================================
``server``  the MCP tools and the stubs resource, shared by both fronts
``front``   ``/mcp``: the Streamable HTTP front, mounted on the app; its tools run in-process on the job service as
            the request's key
``stdio``   ``ptc-sandbox mcp``: the same tools over stdio, forwarding to a running service over HTTP
==========  ========================================================================================================

Not to be confused with the MCP *client* the broker uses to call MCP endpoints (``service.toolkit.mcp_http``).
"""
