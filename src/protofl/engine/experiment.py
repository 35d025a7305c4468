"""The round loop. It knows no algorithm: it samples clients, hands out work, calls a trainer
and the algorithm's aggregation, measures, and checkpoints."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from protofl.algorithms import prototypes as pm
from protofl.algorithms.base import client_prototypes
from protofl.algorithms.registry import make_algorithm
from protofl.config import Config
from protofl.data.registry import dataset_spec, load_dataset
from protofl.engine import runfolder
from protofl.engine.schedule import PROBE, SAMPLE, STRAGGLE, assign_work, np_rng, sample_clients
from protofl.engine.train import ClientResult, LocalSetup, train_sequential
from protofl.engine.vectorized import train_vectorized, vectorize_reason
from protofl.errors import ProtoflError
from protofl.metrics import federated as fm
from protofl.models.registry import build_model

log = logging.getLogger("protofl")

Trainer = Callable[..., list[ClientResult]]


def select_trainer(name: str, alg, model) -> tuple[Trainer, str]:
    """The trainer a config asks for; ``vectorized`` and ``auto`` train sequentially, saying
    why, when the model or the loss cannot be vectorized."""
    reason = None if name == "sequential" else vectorize_reason(alg, model)
    if name == "sequential" or reason is not None:
        if reason is not None:
            log.info("training sequentially: %s", reason)
        return train_sequential, "sequential"
    return train_vectorized, "vectorized"


class Experiment:
    """One federated run, step by step. ``run()`` goes to the end; ``out`` makes it a folder."""

    def __init__(self, cfg: Config, out: Path | None = None, progress: bool = False):
        self.cfg, self.out, self.progress = cfg, out, progress
        self.data = data = load_dataset(cfg.data)
        c = cfg.clients
        if c.per_round > data.num_clients:
            raise ProtoflError(f"config: clients.per_round = {c.per_round} exceeds the "
                               f"{data.num_clients} clients of {data.name}")
        name = cfg.model.name if cfg.model.name != "auto" else dataset_spec(cfg.data.name).model
        torch.manual_seed(cfg.seed)
        self.model = build_model(name, data.input_shape, data.num_classes, cfg.model)
        self.alg = make_algorithm(cfg.algorithm, cfg.algo, self.model, data.num_classes)
        self.model = self.alg.model  # the algorithm's own model (e.g. with a MOON head)
        self.state = self.alg.init_state(self.model)
        self.client_states: dict[int, dict] = {}
        self.protos = torch.zeros(data.num_classes, self.model.feature_dim)  # AMM reference
        self.round = 0
        self.elapsed = 0.0
        self.sampling = c.sampling or self.alg.sampling
        self.tolerate = self.alg.tolerate_partial if c.tolerate_partial is None else (
            c.tolerate_partial)
        self.setup = LocalSetup(c.batch_size, c.local_steps is not None, c.optimizer, c.lr,
                                c.momentum, c.weight_decay, cfg.seed)
        self.trainer, self.trainer_name = select_trainer(cfg.trainer, self.alg, self.model)

    # ---- one round ----
    def step(self) -> dict:
        cfg, c, data = self.cfg, self.cfg.clients, self.data
        t = self.round + 1
        start = time.perf_counter()
        active = sample_clients(data.train_sizes, c.per_round, self.sampling,
                                np_rng(cfg.seed, SAMPLE, t))
        full = c.local_steps or c.local_epochs
        jobs = assign_work(active, full, c.stragglers, self.tolerate,
                           np_rng(cfg.seed, STRAGGLE, t))
        glob = self.alg.broadcast(self.state)
        results = self.trainer(self.alg, self.model, glob, jobs, data, self.client_states,
                               self.setup, t)
        record: dict = {"round": t, "clients": [r.client for r in results],
                        "stragglers": [j.client for j in jobs if j.straggler],
                        "dropped": sorted(set(active.tolist()) - {j.client for j in jobs})}
        for r in results:
            if r.state:
                self.client_states[r.client] = r.state
        if results:
            self.state, diag = self.alg.aggregate(self.state, [r.upload for r in results])
            record.update(diag)
            record["client_loss"] = float(np.mean([r.loss for r in results]))
            if cfg.metrics.amm:
                record["amm"] = self._amm(results)
        self.round = t
        if t % cfg.eval_every == 0 or t == cfg.rounds:
            record.update(self.evaluate())
        self.elapsed += time.perf_counter() - start
        record["seconds"] = round(self.elapsed, 4)
        return record

    def _amm(self, results: list[ClientResult]) -> float:
        """Update the reference aggregate prototypes and return the round's AMM."""
        protos, counts = [], []
        for r in results:
            up = r.upload
            if "protos" in up and up["protos"].shape == self.protos.shape:
                p, n = up["protos"], up["counts"]
            else:
                x, y = self.data.client_train(r.client)
                p, n = client_prototypes(self.model, up["params"], up["buffers"], x, y,
                                         self.data.num_classes)
            protos.append(p)
            counts.append(n)
        protos_t, counts_t = torch.stack(protos), torch.stack(counts)
        self.protos = pm.aggregate_prototypes(protos_t, counts_t, self.protos)
        return fm.aggregate_mean_margin(protos_t, counts_t, self.protos)

    def evaluate(self) -> dict:
        """Figures of the aggregate model (or, for personalised methods, of each client's own
        model on its own test split, pooled)."""
        cfg, data, alg, state = self.cfg, self.data, self.alg, self.state
        batch = cfg.metrics.eval_batch
        preds = fm.client_predictions(alg, self.model, state, data, self.client_states, batch)
        out = {} if alg.personalized else fm.evaluate(
            alg, self.model, state["params"], state["buffers"], state, data.x_test, data.y_test,
            data.num_classes, batch)
        out.update(fm.client_figures(preds, data.num_classes, pooled=alg.personalized))
        if "params" in state:
            out["train_loss"] = fm.train_loss(alg, self.model, state, data,
                                              cfg.metrics.train_loss_samples, cfg.seed, batch)
            n = min(cfg.metrics.dissimilarity_clients, data.num_clients)
            if n:
                probe = np.sort(np_rng(cfg.seed, PROBE).choice(data.num_clients, n,
                                                                replace=False))
                out["dissimilarity"] = fm.gradient_dissimilarity(
                    self.model, state["params"], state["buffers"], data, probe)
        return out

    # ---- checkpoints ----
    def snapshot(self) -> dict:
        return {"round": self.round, "state": self.state, "client_states": self.client_states,
                "protos": self.protos, "elapsed": self.elapsed,
                "torch_rng": torch.get_rng_state()}

    def restore(self, snap: dict) -> None:
        self.round, self.state = snap["round"], snap["state"]
        self.client_states, self.protos = snap["client_states"], snap["protos"]
        self.elapsed = snap["elapsed"]
        torch.set_rng_state(snap["torch_rng"])

    # ---- the whole run ----
    def run(self) -> dict:
        cfg, out = self.cfg, self.out
        rounds = range(self.round + 1, cfg.rounds + 1)
        bar = None
        if self.progress:
            from tqdm import tqdm
            bar = tqdm(total=cfg.rounds, initial=self.round, unit="round", leave=False,
                       desc=f"{self.alg.name} {self.data.name} seed {cfg.seed}")
        last: dict = {}
        if out is not None and (out / runfolder.METRICS).exists():
            done = runfolder.read_metrics(out)
            last = done[-1] if done else {}
        for _ in rounds:
            record = self.step()
            if "accuracy" in record:
                last = record
            if out is not None and "accuracy" in record:
                runfolder.append_metrics(out, record)
            if out is not None and cfg.checkpoint_every and (
                    self.round % cfg.checkpoint_every == 0 or self.round == cfg.rounds):
                runfolder.save_checkpoint(out, self.snapshot())
            if bar is not None:
                bar.update(1)
                if "accuracy" in record:
                    bar.set_postfix(acc=f"{record['accuracy']:.3f}")
        if bar is not None:
            bar.close()
        summary = self.summary(last)
        if out is not None:
            runfolder.write_json(out / runfolder.SUMMARY, summary)
        return summary

    def summary(self, last: dict) -> dict:
        keep = {k: v for k, v in last.items() if not isinstance(v, list) or k == "confusion"}
        return {"algorithm": self.alg.name, "dataset": self.data.name, "seed": self.cfg.seed,
                "rounds": self.round, "trainer": self.trainer_name,
                "seconds": round(self.elapsed, 3), **keep}


def run_experiment(cfg: Config, out: Path | None = None, *, overwrite: bool = False,
                   progress: bool = False) -> dict:
    """Run ``cfg`` to the end, writing a run folder at ``out`` if given."""
    exp = Experiment(cfg, out, progress)
    if out is not None:
        runfolder.prepare(out, overwrite)
        runfolder.write_json(out / runfolder.CONFIG, cfg.to_dict())
    summary = exp.run()
    if out is not None:
        from protofl.report.plots import plot_run
        plot_run(out)
    return summary


def resume_experiment(out: Path, progress: bool = False) -> dict:
    """Continue a killed run from its last checkpoint; it ends as an uninterrupted run would."""
    from protofl.config import config_from_dict

    cfg = config_from_dict(runfolder.load_config_json(out))
    exp = Experiment(cfg, out, progress)
    exp.restore(runfolder.load_checkpoint(out))
    runfolder.truncate_metrics(out, exp.round)
    summary = exp.run()
    from protofl.report.plots import plot_run
    plot_run(out)
    return summary
