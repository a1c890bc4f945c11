"""Adapters of agent frameworks to this service (docs/adapters/README.md); each module imports its framework, so
import only the one you use (``pip install 'ptc-sandbox-client[<framework>]'``)."""
