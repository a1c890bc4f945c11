"""Request and response models of the HTTP API (each route's body and answer; served as ``/openapi.json``).

One module per resource: ``job_models`` (``POST /execute``, ``JobView`` and its parts, ``GET /jobs``),
``session_models`` (``/sessions``), ``toolset_models`` (``/stubs``, ``/toolsets``); ``common`` holds what their
bodies share (``Limits``, ``FileIn``, ``Env``, ``Metadata``). Import a model from its module.
"""
