"""The centralized baseline: one client holding all the training data.

The seeds compare federated methods with a model trained on the pooled data. Here it is FedAvg
on a transformed spec, so that it runs through the same loop, model, metrics and run folder:
``data.pooled`` (which ``central`` sets) pools the federation into one client
(``FederatedData.pooled``) that takes, each round, the expected number of local steps of a
federated round (``engine.schedule.step_budget``), so a round of ``central`` and a round of
``fedavg`` take the same number of SGD steps.
"""

from __future__ import annotations

from protofl.algorithms.fedavg import FedAvg


class Central(FedAvg):
    name = "central"
    description = ("centralized baseline: one client holding all the training data, the "
                   "federated runs' model and SGD steps per round")
    data_defaults = {"pooled": True}
