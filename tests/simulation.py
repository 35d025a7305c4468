"""Flower's simulation engine for the tests: protofl's ClientApp, and one simulation of it."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp

from protofl.flower import client_app as protofl_client


def client_app(train: Callable = protofl_client.train,
               wrap: Callable[[Callable], Callable] = lambda f: f) -> ClientApp:
    """protofl's ClientApp handlers (``train`` replaceable), each passed through ``wrap``."""
    app = ClientApp()
    app.train()(wrap(train))
    app.query()(wrap(protofl_client.describe))
    app.evaluate()(wrap(protofl_client.evaluate))
    return app


def simulate(server: ServerApp, client: ClientApp, supernodes: int, env: dict[str, str]
             ) -> float:
    """``run_simulation`` on 2 Ray CPUs, one per ClientApp, with ``env`` set for its workers
    (and removed after); returns its seconds."""
    from flwr.simulation import run_simulation

    start = time.monotonic()
    os.environ.update(env)  # before Ray starts its workers
    try:
        run_simulation(server, client, num_supernodes=supernodes,
                       backend_config={"client_resources": {"num_cpus": 1},
                                       "init_args": {"num_cpus": 2}})
    finally:
        for key in env:
            os.environ.pop(key, None)
    return time.monotonic() - start
