"""Helper of tests/test_flower.py (not a test): one protofl run on Flower's simulation engine
that stops after round 1 (its checkpoint written) and waits there to be killed.

    python tests/flower_kill_run.py CONFIG.json OUT MARKER
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation

from protofl.config import config_from_dict
from protofl.engine.callbacks import Callback
from protofl.flower.client_app import app as client_app
from protofl.flower.node import AUDIT_ENV
from protofl.flower.server_app import run_on_grid


class HangAfterRoundOne(Callback):
    """After round 1's line and checkpoint: touch ``marker``, then wait for the kill."""

    def __init__(self, marker: Path):
        self.marker = marker

    def on_round_end(self, exp, record):
        if exp.round == 1:
            self.marker.write_text("round 1 done")
            time.sleep(3600)


def main() -> None:
    cfg = config_from_dict(json.loads(Path(sys.argv[1]).read_text()))
    out, marker = Path(sys.argv[2]), Path(sys.argv[3])
    os.environ.setdefault(AUDIT_ENV, str(marker.parent / "audit_killed"))  # not the cwd
    torch.set_num_threads(1)
    server = ServerApp()

    @server.main()
    def _(grid: Grid, context) -> None:
        run_on_grid(cfg, grid, out, round_timeout=600, node_wait=300,
                    callbacks=[HangAfterRoundOne(marker)])

    run_simulation(server, client_app, num_supernodes=cfg.data.num_clients,
                   backend_config={"client_resources": {"num_cpus": 1},
                                   "init_args": {"num_cpus": 2}})


if __name__ == "__main__":
    main()
