"""Observability: what the service tells its operator, apart from its answers.

==============  ===================================================================================================
module          owns
==============  ===================================================================================================
``metrics``     Prometheus metrics, one helper per thing counted, and ``HttpObserver`` (the HTTP middleware)
``logs``        structured logs, one JSON object per event
``telemetry``   OpenTelemetry traces (off by default): the request, job and tool call spans, ``traceparent`` out
``stages``      the stages of one request timed (``Ptc-Stages``, the start-latency benchmark)
==============  ===================================================================================================

Metrics and logs subscribe to the job service's lifecycle events in the composition root; the run path imports
neither.
"""
