"""The round loop. It knows no algorithm and no metric: it samples clients, hands the round to
a trainer, asks the algorithm to aggregate, and calls the round callbacks
(``engine/callbacks.py``) that measure, write and checkpoint."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path

import numpy as np
import torch

from protofl import device as devices
from protofl.algorithms.base import validate_upload
from protofl.algorithms.registry import ALGORITHMS, algorithm_class, make_algorithm
from protofl.config import Config, resolve_defaults
from protofl.data.federated import FederatedData
from protofl.data.pipeline import augmentation
from protofl.data.registry import dataset_spec, dataset_task, load_dataset
from protofl.engine import runfolder
from protofl.engine.callbacks import Callback, load_callback, metric_callbacks
from protofl.engine.parallel import choose_trainer, resolve_workers, usable_cores
from protofl.engine.private import PrivateRounds, dp_on
from protofl.engine.schedule import assign_work, sample_clients, step_budget
from protofl.engine.train import ClientResult, LocalSetup, RoundContext, Trainer
from protofl.errors import Diverged, ProtoflError
from protofl.models.registry import build_model, resolve_model_config
from protofl.nested import flatten
from protofl.seeding import SAMPLE, STRAGGLE, np_rng

log = logging.getLogger("protofl")

SMALL_MODEL = 1_000_000  # parameters: below this, one thread is fastest (no sync overhead)


def auto_threads(model: torch.nn.Module) -> int:
    """Torch threads for a run: 1 for small models, whose operations are too short to share
    (more threads only spin, badly so when anything else runs); half the usable cores else."""
    if sum(p.numel() for p in model.parameters()) < SMALL_MODEL:
        return 1
    return max(1, usable_cores() // 2)


def check_task(cfg: Config) -> str:
    """The run's task (the dataset's; ``cfg.task``, when set, must agree), and that the
    algorithm is written for it: one-line errors otherwise."""
    task = dataset_task(cfg.data.name, cfg.task)
    cls = algorithm_class(cfg.algorithm)
    if task not in cls.tasks:
        fit = [n for n in ALGORITHMS if task in algorithm_class(n).tasks]
        raise ProtoflError(f"algorithm {cls.name!r} supports {' and '.join(cls.tasks)} only, "
                           f"not {task} ({cfg.data.name}); {task} algorithms: {', '.join(fit)}")
    return task


class Experiment:
    """One federated run, step by step; ``run()`` goes to the end.

    ``cfg`` becomes the resolved config (``self.cfg``: every default filled in, the
    algorithm's options and paper defaults, the model and client count). ``trainer`` replaces
    the one ``cfg.trainer`` names; ``callbacks`` replaces the default metric callbacks (the
    config's ``callbacks`` are added either way); the ``data`` argument replaces the federation
    ``cfg.data`` names (a Flower site's own files). ``self.data`` is the federation (the metrics
    score its clients); ``train_data`` is what clients train on: the same, or for the
    centralized baseline the federation pooled into one client, which then takes a federated
    round's expected SGD steps each round.
    """

    def __init__(self, cfg: Config, *, trainer: Trainer | None = None,
                 callbacks: list[Callback] | None = None, data: FederatedData | None = None):
        self.device = devices.resolve(cfg.device)
        devices.set_deterministic(cfg.deterministic)
        self.server = devices.server_device(self.device)  # the state and aggregation
        spec = dataset_spec(cfg.data.name)
        task = check_task(cfg)  # before anything is loaded
        model_name = cfg.model.name if cfg.model.name != "auto" else spec.model
        model_cfg = resolve_model_config(model_name, cfg.model, spec.model_options)
        self.data = data = data if data is not None else load_dataset(
            cfg.data, lean=True)  # rows as stored (e.g. uint8)
        torch.manual_seed(cfg.seed)
        model = build_model(model_name, data.input_shape, data.num_classes, model_cfg)
        self.alg = make_algorithm(cfg.algorithm, cfg.algo, model, data.num_classes)
        self.alg.model.to(self.device)  # built on the CPU: the same weights on every device
        threads = cfg.threads or auto_threads(self.alg.model)
        torch.set_num_threads(threads)
        augment = cfg.data.augment or spec.augment
        if augment != "none" and len(data.input_shape) != 3:
            raise ProtoflError(f"config: data.augment = {augment} needs images (C, H, W); "
                               f"{data.name} rows are {data.input_shape}")
        defaults = dict(self.alg.client_defaults)
        if dp_on(cfg) and cfg.clients.sampling is None:
            defaults["sampling"] = "uniform"  # DP cannot account for size-weighted sampling
        self.cfg = cfg = dataclasses.replace(
            cfg, algorithm=self.alg.name, algo=self.alg.options(), threads=threads, task=task,
            workers=resolve_workers(cfg.workers),
            data=dataclasses.replace(cfg.data, num_clients=data.num_clients,
                                     partition=cfg.data.partition or spec.partition,
                                     augment=augment),
            model=dataclasses.replace(model_cfg, name=model_name),
            clients=resolve_defaults(cfg.clients, defaults),
            metrics=resolve_defaults(cfg.metrics, {"save_weights": self.alg.centralized}))
        c = cfg.clients
        if c.per_round > data.num_clients:
            raise ProtoflError(f"config: clients.per_round = {c.per_round} exceeds the "
                               f"{data.num_clients} clients of {data.name}")
        self.train_data = data
        if self.alg.centralized:
            self.train_data = data.pooled()
            budget = step_budget(data.train_sizes, c.per_round, c.local_epochs, c.local_steps,
                                 c.batch_size)
            self.cfg = cfg = dataclasses.replace(cfg, clients=dataclasses.replace(
                c, per_round=1, local_steps=budget, stragglers=0.0))
            c = cfg.clients
        self.state = devices.to_device(self.alg.init_state(self.alg.model), self.server)
        if cfg.metrics.save_weights and self.alg.global_weights(self.state) is None:
            raise ProtoflError(f"config: metrics.save_weights: {self.alg.name} has no "
                               "aggregate model to save (each client keeps its own)")
        self.private = PrivateRounds.build(cfg, self.alg, data.num_clients, self.state)
        self.client_states: dict[int, dict] = {}  # on the CPU; moved over while active
        self.round = 0
        self.stopped = ""  # why the run ended before cfg.rounds (the privacy budget)
        self.elapsed = 0.0
        self.last: dict = {}  # the last evaluated round's record
        self.setup = LocalSetup(c.batch_size, c.local_steps is not None, c.optimizer, c.lr,
                                c.momentum, c.weight_decay, cfg.seed, str(self.device),
                                cfg.precision, augmentation(augment))
        self.trainer = trainer or choose_trainer(cfg.trainer, self.alg.model, self.device,
                                                 cfg.workers, cfg.precision)
        self.callbacks = (metric_callbacks() if callbacks is None else list(callbacks)) + [
            load_callback(path) for path in cfg.callbacks]

    def client_inputs(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Client ``k``'s training inputs (as the model sees them) and labels, where the server
        state is (to meet uploads)."""
        x, y = self.train_data.client_train(k)
        return self.train_data.inputs(devices.upload(x, self.server)), y.to(self.server)

    def autocast(self):
        """The run's precision for forward passes (evaluation, metrics)."""
        return devices.autocast(self.device, self.cfg.precision)

    @property
    def individual(self) -> bool:
        """Whether the round's results are the clients' own uploads (not contributions to a
        sum: client-side DP noise, secure aggregation)."""
        return self.private is None or not self.private.from_clients

    def evaluating(self, round: int) -> bool:
        return (round % self.cfg.eval_every == 0 or round == self.cfg.rounds
                or bool(self.stopped))

    # ---- one round ----
    def step(self) -> dict:
        cfg, c, data = self.cfg, self.cfg.clients, self.train_data
        t = self.round + 1
        start = time.perf_counter()
        active = sample_clients(data.train_sizes, c.per_round, c.sampling,
                                np_rng(cfg.seed, SAMPLE, t))
        jobs = assign_work(active, c.local_steps or c.local_epochs, c.stragglers,
                           c.tolerate_partial, np_rng(cfg.seed, STRAGGLE, t))
        rc = RoundContext(self.alg, self.alg.broadcast(self.state), jobs, data,
                          self.client_states, self.setup, t,
                          None if self.individual else self.private.client_hook)
        trained = self.trainer.train(rc)
        results, rejected = self.screen(trained, t)
        if trained and all(not math.isfinite(r.loss) for r in trained):
            raise Diverged(f"round {t}: local training diverged on every client (training "
                           "loss NaN/Inf), so the run stopped; lower clients.lr")
        for r in results:  # uploads meet the server state on its device; states wait on the CPU
            r.upload, r.state = devices.to_device(r.upload, self.server), devices.to_host(r.state)
        record: dict = {"round": t, "clients": [r.client for r in results],
                        "stragglers": [j.client for j in jobs if j.straggler],
                        "dropped": sorted(set(active.tolist()) - {j.client for j in jobs}),
                        "rejected": rejected}
        for r in results:
            if r.state:
                self.client_states[r.client] = r.state
        if results:
            uploads = [r.upload for r in results]
            self.state, diag = (self.alg.aggregate(self.state, uploads, t) if self.private is None
                                else self.private.aggregate(self.state, rc.broadcast, uploads, t))
            finite = [torch.isfinite(v).all() for v in flatten(self.state).values()
                      if isinstance(v, torch.Tensor) and v.is_floating_point()]
            if finite and not bool(torch.stack(finite).all()):  # one device sync, not one each
                raise Diverged(f"round {t}: the global model became NaN/Inf from finite "
                               "client updates, so the run stopped; lower clients.lr")
            record.update(diag)
            record["client_loss"] = float(np.mean([r.loss for r in results]))
        if self.private is not None and self.private.dp:
            record["epsilon"] = self.private.epsilon()
            if t < cfg.rounds and not self.private.allows(t + 1):
                self.stopped = "privacy budget"
        for cb in self.callbacks:
            cb.after_aggregate(self, record, results)
        self.round = t
        if self.evaluating(t):
            for cb in self.callbacks:
                cb.on_evaluate(self, record)
        self.elapsed += time.perf_counter() - start
        record["seconds"] = round(self.elapsed, 4)
        if "accuracy" in record:
            self.last = record
        return record

    def screen(self, results: list[ClientResult], t: int
               ) -> tuple[list[ClientResult], list[int]]:
        """The results fit to aggregate, and the clients left out (logged): a non-finite
        training loss, or an upload that fails ``validate_upload`` (missing or misshapen
        entries, NaN/Inf, negative counts)."""
        spec = self.alg.upload_spec() if self.private is None else self.private.spec()
        kept, rejected = [], []
        for r in results:
            try:
                if not math.isfinite(r.loss):
                    raise ProtoflError(f"its training loss is {r.loss}")
                validate_upload(r.upload, spec)
            except ProtoflError as e:
                log.warning("round %d: client %d left out: %s", t, r.client, e)
                rejected.append(r.client)
                continue
            kept.append(r)
        return kept, rejected

    # ---- checkpoints ----
    def snapshot(self) -> dict:
        """Everything a checkpoint holds, every tensor on the CPU."""
        return devices.to_host({
            "round": self.round, "state": self.state, "client_states": self.client_states,
            "elapsed": self.elapsed, "last": self.last, "torch_rng": torch.get_rng_state(),
            "callbacks": {cb.name: cb.state_dict() for cb in self.callbacks},
            "privacy": self.private.state_dict() if self.private else {}})

    def restore(self, snap: dict) -> None:
        self.round, self.state = snap["round"], devices.to_device(snap["state"], self.server)
        self.client_states, self.elapsed = devices.to_host(snap["client_states"]), snap["elapsed"]
        self.last = snap.get("last", {})
        torch.set_rng_state(snap["torch_rng"])
        for cb in self.callbacks:
            cb.load_state_dict(devices.to_device(snap.get("callbacks", {}).get(cb.name, {}),
                                                 self.server))
        if self.private is not None:
            self.private.load_state_dict(snap.get("privacy", {}))

    def resume(self, out: Path, snap: dict) -> None:
        """Continue the run folder ``out`` from its checkpoint ``snap``: restored, its
        ``metrics.jsonl`` checked to hold every evaluated round up to it, and its
        ``config.json`` rewritten when the run was extended to more rounds."""
        if self.cfg.rounds < snap["round"]:
            raise ProtoflError(f"rounds = {self.cfg.rounds}: {out} has already run "
                               f"{snap['round']} rounds; give at least that many")
        self.restore(snap)
        runfolder.check_history(out, self.round, self.cfg.eval_every, self.cfg.rounds)
        if runfolder.load_config_json(out).get("rounds") != self.cfg.rounds:
            runfolder.write_json(out / runfolder.CONFIG, self.cfg.to_dict())

    # ---- the whole run ----
    def run(self) -> dict:
        """Rounds up to ``cfg.rounds`` (from where a restored run stopped); the summary."""
        for cb in self.callbacks:
            cb.on_run_start(self)
        if (self.private is not None and self.round < self.cfg.rounds
                and not self.private.allows(self.round + 1)):
            self.stopped = "privacy budget"  # a resumed run that had reached it
        try:
            while self.round < self.cfg.rounds and not self.stopped:
                record = self.step()
                for cb in self.callbacks:
                    cb.on_round_end(self, record)
        finally:
            self.close()
        summary = self.summary()
        for cb in self.callbacks:
            cb.on_run_end(self, summary)
        return summary

    def close(self) -> None:
        """Release what the trainer holds (the parallel trainer's worker processes)."""
        close = getattr(self.trainer, "close", None)
        if close is not None:
            close()

    def summary(self) -> dict:
        keep = {k: v for k, v in self.last.items()
                if not isinstance(v, list) or k == "confusion"}
        return {"algorithm": self.alg.name, "dataset": self.data.name, "seed": self.cfg.seed,
                "rounds": self.round, "trainer": self.trainer.name, "device": str(self.device),
                "seconds": round(self.elapsed, 3), **keep,
                **({"stopped": self.stopped} if self.stopped else {})}
