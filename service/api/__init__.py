"""The HTTP API: ``create_app`` builds it.

Modules: ``app`` (the app factory, the composition root), ``deps`` (what routes depend on), ``routers/`` (one
per resource: jobs, sessions, tools, health), ``problems`` (errors to RFC 9457 problem+json: one table, one
handler), ``bodies`` (request body limit, parsing off the event loop), ``responses`` (streamed views and output).
"""

from service.api.app import create_app

__all__ = ["create_app"]
