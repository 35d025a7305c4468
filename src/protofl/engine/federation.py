"""The one builder: a config becomes a :class:`Federation`, built once.

A Federation is everything a run is made of before its first round: the resolved spec, the
data (and what clients train on), the model wrapped by its algorithm, the devices, the local
training settings and the initial server state. The in-process round loop
(``engine/experiment.py``) and the Flower ClientApp and ServerApp all start from one::

    fed = build(config_from_dict({"algorithm": "fedavg", "data": {"name": "digits"}}))
    fed.alg.aggregate(fed.state, uploads, round=1)

Building draws the model's initial weights from the run seed in a forked generator, so the
caller's torch generator is untouched; the generator's state after building is kept
(``rng``) for the round loop to continue from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protofl import device as devices
from protofl.algorithms.base import Algorithm, FederationInfo, Tensors
from protofl.algorithms.registry import make_algorithm
from protofl.config import Config
from protofl.data.federated import FederatedData
from protofl.data.pipeline import augmentation
from protofl.data.registry import load_dataset
from protofl.engine import hetero
from protofl.engine.spec import RunSpec, check_sizes, resolve, resolve_data
from protofl.engine.train import LocalSetup
from protofl.errors import ProtoflError
from protofl.models.registry import build_model
from protofl.seeding import VALIDATION, np_rng


@dataclass
class Federation:
    """A run's data, algorithm, devices and initial state (see the module docstring)."""

    spec: RunSpec
    data: FederatedData  # the federation (the metrics score its clients)
    train_data: FederatedData  # what clients train on: ``data``, or pooled for ``central``
    alg: Algorithm  # ``alg.model`` is the model trained, on ``device``
    device: torch.device  # where clients train and the model is evaluated
    server: torch.device  # where the server state lives and aggregation runs
    setup: LocalSetup
    state: Tensors  # the initial server state, on ``server``
    rng: torch.Tensor  # torch's generator state after the model was built
    validation: FederatedData | None = None  # local test splits = the held-out rows

    def client_inputs(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Client ``k``'s training inputs (as the model sees them) and labels, where the
        server state is (to meet uploads)."""
        x, y = self.train_data.client_train(k)
        return self.train_data.inputs(devices.upload(x, self.server)), y.to(self.server)


def info(data: FederatedData) -> FederationInfo:
    """The read-only description of ``data`` an algorithm is built with."""
    sizes = tuple(int(n) for n in data.train_sizes) if data.sizes_known else None
    return FederationInfo(data.num_clients, data.num_classes, sizes)


def local_setup(spec: RunSpec, device: torch.device) -> LocalSetup:
    c = spec.clients
    return LocalSetup(c.batch_size, c.local_steps is not None, c.optimizer, c.lr, c.momentum,
                      c.weight_decay, spec.seed, str(device), spec.precision,
                      augmentation(spec.data.augment), c.lr_decay)


def build(cfg: Config, data: FederatedData | None = None, *, holds_clients: bool = True
          ) -> Federation:
    """The Federation ``cfg`` names (resolved first); ``data`` replaces the federation its
    data section names (a Flower site's own files). ``holds_clients`` False: sized for a
    Flower server or node, which holds no other client's state (``sizes.model_bytes``)."""
    dev = devices.resolve(cfg.device)
    if data is None:
        data = load_dataset(resolve_data(cfg.data), lean=True)  # rows as stored (e.g. uint8)
    spec = resolve(cfg, data)
    validation = None
    if spec.data.validation_fraction:
        data, validation = data.hold_out(spec.data.validation_fraction,
                                         np_rng(spec.data.seed, VALIDATION))
    train_data = data.pooled() if spec.data.pooled else data
    check_sizes(spec, data, train_data, dev, holds_clients)  # before the model is allocated
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        if hetero.requested(spec.model):  # a model per client group (engine/hetero.py)
            alg, _ = hetero.make(spec, data, info(data))
        else:
            model = build_model(spec.model.name, data.input_shape, data.num_classes,
                                spec.model)
            alg = make_algorithm(spec.algorithm, spec.algo, model, data.num_classes,
                                 info(data))
        state = hetero.init_state(alg)  # (some draw from the generator)
        rng = torch.get_rng_state()
    hetero.to_device(alg, dev)  # built on the CPU: the same weights on every device
    server = devices.server_device(dev)
    state = devices.to_device(state, server)
    if spec.metrics.save_weights and alg.global_weights(state) is None:
        raise ProtoflError(f"config: metrics.save_weights: {alg.name} has no aggregate model "
                           "to save (each client keeps its own)")
    return Federation(spec, data, train_data, alg, dev, server, local_setup(spec, dev), state,
                      rng, validation)
