"""The composition root and what it builds, one module each (this ``__init__`` imports nothing):

- ``root``: the one composition root, ``open_services``: everything the app serves, built and started in order
  from settings; ``Services`` holds it and closes it in reverse.
- ``assembly``: ``build_jobs``, the job service's parts built in order and wired (lifecycle events observed by
  metrics, logs and webhooks; the replicas' background work).
- ``job_manager``: ``JobManager``, the job service as the fronts use it (its parts started and closed in order,
  what spans parts), and ``JobParts``.
- ``engine_table``: the script engines a service runs (``ENGINES``), today's (``container_engine``), and the
  sandbox backend by default (``docker_backend``).
"""
