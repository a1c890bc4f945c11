"""Adapters of agent frameworks to the service, one module each, imported by name (each needs its framework:
``pip install 'ptc-sandbox-client[<framework>]'``); this package imports none of them."""
