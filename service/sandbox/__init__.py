"""The sandbox layer: everything that owns a sandbox, from the engine to a run's exit.

- ``base``: the backend interface (``SandboxBackend``) and its values (``SandboxSpec``, ``SandboxHandle``,
  ``ExitStatus``, ``OutputSink``); ``write_run_files`` lays out a run's folder.
- ``docker``: the Docker backend (the only module that imports the Docker SDK); ``fake``: an in-memory backend with
  a fake resident interpreter, for tests without an engine.
- ``resident``: ``ResidentSandbox`` and ``ResidentRun``, the service's side of the control protocol
  (``ptc_runtime.protocol``): every run, cold, pooled or in a session, goes through them.
- ``pool``: the warm pool (``WarmPools``): resident sandboxes started ahead of time, each used once.
- ``labels``: every ``io.ptc-sandbox.*`` label and the runtime features an image lists.
- ``spec``: the ``SandboxSpec`` of a run, from the settings and its limits.
- ``folders`` (the tmpfs that holds the sandboxes' folders) and ``seccomp`` (the sandboxes' seccomp profile).
"""

from service.sandbox.backend import ExitStatus, OutputSink, SandboxBackend, SandboxHandle, SandboxSpec

__all__ = ["ExitStatus", "OutputSink", "SandboxBackend", "SandboxHandle", "SandboxSpec"]
