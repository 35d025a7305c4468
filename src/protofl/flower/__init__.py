"""protofl on Flower: a ServerApp and a ClientApp over the same algorithm code as the engine.

Needs the optional extra ``protofl[flower]``; the rest of protofl never imports flwr.
``server_app:app`` and ``client_app:app`` are the components named in ``pyproject.toml``.
"""
