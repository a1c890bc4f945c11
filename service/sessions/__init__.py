"""Sessions: one sandbox kept for a conversation, running its scripts one at a time (docs/sessions.md).

============  =====================================================================================================
module        owns
============  =====================================================================================================
``manager``   the sessions resource (``SessionManager``, ``Session``): owners, each session's queue and turn, idle
              and lifetime expiry, on top of ``service.sandbox.resident``; below the job service
``requests``  sessions as the job service offers them (``SessionJobs``): creating one (limits, runtime, manifest,
              quotas, room on the host), reading, files, ending; above the job service
============  =====================================================================================================
"""
