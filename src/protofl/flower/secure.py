"""Secure aggregation (Flower's SecAgg+) and client-side DP noise on Flower (docs/privacy.md).

With ``privacy.secagg`` the server never sees a client's upload: each round runs Flower's
``SecAggPlusWorkflow`` (the legacy ``FitIns``/``FitRes`` protocol, called once per round
from the engine's loop by :class:`SecureTrainer`), and each ClientApp answers through
``secaggplus_mod`` with its *contribution* (``privacy.contrib``: weighted update, weights,
prototype sums and counts, with its share of the DP noise when ``privacy.noise: client``),
all packed into the masked vector, its training loss included (clamped to the range). Every
client reports weight 1 (``FitRes.num_examples`` travels in the clear, so no real weight goes
there); SecAgg+ returns the mean of the vectors over the K'' clients that finished, which
times K'' is the sum the engine's privacy layers (``engine/private.py``) turn into the next state.

Without SecAgg, ``privacy.noise: client`` still has each ClientApp send its noised
contribution instead of its upload (``secure_client.upload_hook``, the ClientApp's half of
this module, kept apart so nodes import no server code). A node draws its noise from its own
operating system's CSPRNG: no seed the server (or anyone) knows can regenerate it. Only with
``privacy.reproducible_noise`` (tests) is it drawn from the run seed, or from the node's
``noise-seed`` node config when it sets one.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
from flwr.common import (
    FitIns,
    Parameters,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server import LegacyContext, ServerConfig
from flwr.server.client_manager import SimpleClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.strategy import Strategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD, Key
from flwr.serverapp import Grid

from protofl.config import Config
from protofl.engine.train import ClientResult, RoundContext
from protofl.errors import ProtoflError
from protofl.flower.records import (
    tree_to_arrays,
)
from protofl.flower.trainer import FlowerTrainer
from protofl.nested import unflatten

log = logging.getLogger("protofl.flower")

def trainer_for(cfg: Config, grid: Grid, round_timeout: float, node_wait: float,
                min_replies: int = 1) -> FlowerTrainer:
    """The Flower trainer a run needs: SecAgg+ rounds with ``privacy.secagg``, else plain."""
    cls = SecureTrainer if cfg.privacy.secagg else FlowerTrainer
    return cls(grid, round_timeout, node_wait, min_replies)


# ---- server side ----

class _Round(Strategy):
    """The legacy strategy of one SecAgg+ round: the round's jobs out, the secure mean in."""

    def __init__(self, grid: Grid, sends: list[tuple[int, FitIns]]):
        self.grid, self.sends = grid, sends
        self.nodes: list[int] = []
        self.mean: list[np.ndarray] = []
        self.failures = 0

    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: Any
                      ) -> list[tuple[ClientProxy, FitIns]]:
        return [(GridClientProxy(node, self.grid, 0), ins) for node, ins in self.sends]

    def aggregate_fit(self, server_round: int, results: list, failures: list
                      ) -> tuple[None, dict]:
        self.nodes = [proxy.node_id for proxy, _ in results]
        self.failures = len(failures)
        if results:  # every result carries the same aggregate
            self.mean = parameters_to_ndarrays(results[0][1].parameters)
        return None, {}

    def initialize_parameters(self, client_manager: Any) -> None:
        return None

    def configure_evaluate(self, server_round: int, parameters: Parameters,
                           client_manager: Any) -> list:
        return []

    def aggregate_evaluate(self, server_round: int, results: list, failures: list
                           ) -> tuple[None, dict]:
        return None, {}

    def evaluate(self, server_round: int, parameters: Parameters) -> None:
        return None


class SecureTrainer(FlowerTrainer):
    """The Flower trainer whose rounds are SecAgg+ rounds: the server gets only the sum of the
    clients' contributions, returned as one result holding the sum and one zero result per
    other client that finished (so the engine's sum is the secure sum)."""

    name = "flower-secagg"

    def send(self, rc: RoundContext) -> list[ClientResult]:
        exp, rnd = self.exp, rc.round
        p = exp.cfg.privacy
        jobs = []
        for job in rc.jobs:
            if job.client in self.nodes:
                jobs.append(job)
            else:
                self._reject(rnd, job.client, None, "no SuperNode holds this client")
        if len(jobs) < 2:
            for job in jobs:
                self._reject(rnd, job.client, self.nodes[job.client],
                             "SecAgg+ needs at least 2 clients in a round")
            return []
        arrays, skeleton = tree_to_arrays(rc.broadcast)
        params = ndarrays_to_parameters(arrays)
        sends = [(self.nodes[j.client], FitIns(params, {
            "round": rnd, "client": j.client, "units": j.units, "straggler": j.straggler,
            "config": self.cfg_json, "skeleton": skeleton, **self.versions}))
            for j in jobs]
        strategy = _Round(self.grid, sends)
        ctx = LegacyContext(Context(run_id=0, node_id=0, node_config={}, state=RecordDict(),
                                    run_config={}),
                            config=ServerConfig(num_rounds=1), strategy=strategy,
                            client_manager=SimpleClientManager())
        ctx.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({Key.CURRENT_ROUND: rnd})
        ctx.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()
        SecAggPlusWorkflow(p.secagg_shares, p.secagg_threshold, max_weight=1.0,
                           clipping_range=p.secagg_range,
                           timeout=self.round_timeout)(self.grid, ctx)
        client_of = {node: client for client, node in self.nodes.items()}
        done = [client_of[n] for n in strategy.nodes if n in client_of]
        for job in jobs:
            if job.client not in done:
                self._reject(rnd, job.client, self.nodes[job.client],
                             "left out of the SecAgg+ round (error, timeout or too few peers)")
        if not done or not strategy.mean:
            return []
        return self.results(strategy.mean, sorted(done), exp.reply_spec)

    @staticmethod
    def results(mean: list[np.ndarray], clients: list[int], spec: dict) -> list[ClientResult]:
        """The secure mean over ``clients`` as engine results: the sum first, then zeros."""
        k = len(clients)
        if len(mean) != len(spec) + 1:
            raise ProtoflError(f"flower: the SecAgg+ aggregate has {len(mean)} arrays, "
                               f"expected {len(spec) + 1}")
        total = unflatten({name: torch.from_numpy(np.asarray(a, dtype=np.float64) * k)
                           .reshape(entry.shape)
                           for (name, entry), a in zip(spec.items(), mean)})
        loss = float(np.asarray(mean[-1]).reshape(-1)[0])
        zero = unflatten({name: torch.zeros(entry.shape, dtype=torch.float64)
                          for name, entry in spec.items()})
        return [ClientResult(c, total if i == 0 else zero, {}, loss)
                for i, c in enumerate(clients)]
