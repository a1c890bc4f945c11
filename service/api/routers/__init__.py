"""One router per resource: jobs, sessions, tools, health (and metrics)."""
