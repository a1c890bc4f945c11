"""Replicas: several service processes on one PostgreSQL store (docs/scaling.md).

==================  ===============================================================================================
module              owns
==================  ===============================================================================================
``registration``    this replica's registration (instance id, epoch, internal URL), its lease and heartbeat, the
                    registry cache, fencing, and the saves fenced by the incarnation (``Replicas``)
``internal``        signing and checking internal calls (HMAC-SHA256, ``PTC_INTERNAL_SECRET``), the nonces seen
``remote``          the client of the other replicas' internal URLs: a request relayed to its job's owner
``notify``          the ``LISTEN`` connection, the waiters it wakes, and ``Elsewhere`` (a job or session another
                    replica holds)
``reaper``          replicas whose lease passed expired: their jobs ``lost``, their sessions ``broken``
``progress``        a running job's new output and records saved as they grow, so that a lost job keeps them
``fencing``         a replica that lost its lease cancels its callbacks, removes its sandboxes and exits (75)
``sweep``           ``ptc-sandbox sweep --instance ID``: a retired replica's sandboxes removed
==================  ===============================================================================================

``registration``, ``internal``, ``remote`` and ``notify`` sit below the job service (which asks them where a job
is); ``reaper``, ``progress`` and ``fencing`` act on the job service's jobs and sit above it
(``tests/unit/test_layering.py``). The HTTP side of forwarding is ``service.api.forward``.
"""
