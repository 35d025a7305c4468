"""The round loop. It knows no algorithm and no metric: it samples clients, hands the round to
a trainer, asks the algorithm to aggregate, tells its run folder's store
(``engine/runfolder.py:RunStore``) what to write and when to checkpoint, and calls the round
callbacks (``engine/callbacks.py``) that measure, each given a read-only ``RoundView``."""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import torch

from protofl import device as devices
from protofl.algorithms.base import validate_upload
from protofl.config import Config
from protofl.data.federated import FederatedData
from protofl.engine import hetero, trainers
from protofl.engine.aggregation import Aggregation
from protofl.engine.callbacks import Callback, RoundView, load_callback, metric_callbacks
from protofl.engine.divergence import check_loss, remedy
from protofl.engine.federation import Federation, build
from protofl.engine.private import stack
from protofl.engine.runfolder import RunStore, read_plan, should_checkpoint
from protofl.engine.schedule import Job, assign_work, drop_out, sample_clients
from protofl.engine.train import ClientResult, RoundContext, Trainer
from protofl.errors import Diverged, ProtoflError
from protofl.nested import flatten
from protofl.provenance import provenance
from protofl.seeding import DROP, SAMPLE, STRAGGLE, np_rng

log = logging.getLogger("protofl")


class Experiment:
    """One federated run over a :class:`Federation`, step by step; ``run()`` goes to the end.

    ``cfg`` is a config (built into a Federation, its ``data`` argument replacing the
    federation ``cfg.data`` names: a Flower site's own files) or a built Federation.
    ``self.cfg`` is the resolved spec. ``trainer`` replaces the one ``cfg.trainer`` names;
    ``callbacks`` replaces the default metric callbacks (the config's ``callbacks`` are added
    either way). ``store`` is the run folder's :class:`RunStore` (None: nothing is written),
    which the loop calls at the start, every round, at checkpoints and at the end; callbacks
    see the run through a read-only :class:`RoundView`. ``aggregation`` replaces the stack
    the spec asks for (a privacy chain composed in code: ``engine.private.chain``).
    ``self.data`` is the federation (the metrics score its clients); ``train_data`` is what
    clients train on. Aggregation is the
    run's layer stack (``engine/aggregation.py``): the loop never asks whether the run is
    private.

    A run uses torch's global generator (some server rules draw from it) in a fork seeded
    from the federation's, so the caller's generator is left as it was; the run's torch
    thread count (``max(threads, workers)`` while it evaluates) and
    ``deterministic`` settings hold while it runs and are restored afterwards.
    """

    def __init__(self, cfg: Config | Federation, *, trainer: Trainer | None = None,
                 callbacks: list[Callback] | None = None, data: FederatedData | None = None,
                 store: RunStore | None = None, aggregation: Aggregation | None = None):
        self.store = store
        self.fed = fed = cfg if isinstance(cfg, Federation) else build(cfg, data)
        self.cfg, self.data, self.train_data, self.alg = fed.spec, fed.data, fed.train_data, fed.alg
        self.device, self.server, self.setup = fed.device, fed.server, fed.setup
        self.state = fed.state
        self.rng = fed.rng  # torch's generator state for the next round
        self.aggregation: Aggregation = aggregation or stack(
            self.cfg, self.alg, self.data.num_clients, self.state)
        self.client_states: dict[int, dict] = {}  # on the CPU; moved over while active
        self.round = 0
        self.stopped = ""  # why the run ended before cfg.rounds (the privacy budget)
        self.elapsed = 0.0
        self.last: dict = {}  # the last evaluated round's record
        plan = (read_plan(self.cfg.trainer_plan) if self.cfg.trainer_plan and trainer is None
                else None)
        self.trainer = hetero.grouped(trainer or trainers.make(
            self.cfg.trainer, self.alg.model, self.device, self.cfg.workers,
            self.cfg.precision, self.cfg.rounds, self.cfg.calibrate, plan), self.alg)
        self.callbacks = (metric_callbacks() if callbacks is None else list(callbacks)) + [
            load_callback(path) for path in self.cfg.callbacks]
        # evaluation runs between rounds, on every core the run may use (its threads, or its
        # worker processes' one thread each); on any device, for the host's share of it
        self.eval_threads = max(self.cfg.threads, self.cfg.workers)

    def client_inputs(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fed.client_inputs(k)

    def autocast(self):
        """The run's precision for forward passes (evaluation, metrics)."""
        return devices.autocast(self.device, self.cfg.precision)

    @property
    def individual(self) -> bool:
        """Whether the round's results are the clients' own uploads (not contributions to a
        sum: client-side DP noise, secure aggregation)."""
        return self.aggregation.individual

    def view(self, record: dict | None = None) -> RoundView:
        """The read-only view of the run that callbacks are given."""
        return RoundView.of(self.cfg, self.data, self.alg, self.state, self.client_states,
                            self.round, self.device, record, self.aggregation, self.stopped,
                            self.store, self.fed.client_inputs, self.fed.validation)

    def evaluating(self, round: int) -> bool:
        return (round % self.cfg.eval_every == 0 or round == self.cfg.rounds
                or bool(self.stopped))

    # ---- one round ----
    def step(self) -> dict:
        """One round; torch's global generator is the run's during it (a fork)."""
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self.rng)
            record = self._round()
            self.rng = torch.get_rng_state()
        return record

    def jobs(self, t: int) -> tuple[np.ndarray, list[Job]]:
        """Round ``t``'s sampled clients and the local work of those that stay."""
        cfg, c = self.cfg, self.cfg.clients
        active = sample_clients(self.train_data.train_sizes, c.per_round, c.sampling,
                                np_rng(cfg.seed, SAMPLE, t))
        return active, assign_work(drop_out(active, c.dropout, np_rng(cfg.seed, DROP, t)),
                                   c.local_steps or c.local_epochs, c.stragglers,
                                   c.tolerate_partial, np_rng(cfg.seed, STRAGGLE, t))

    def _round(self) -> dict:
        cfg, c, data = self.cfg, self.cfg.clients, self.train_data
        t = self.round + 1
        start = time.perf_counter()
        active, jobs = self.jobs(t)
        rc = RoundContext(self.alg, self.alg.broadcast(self.state), jobs, data,
                          self.client_states, self.setup.at(t), t,
                          self.aggregation.client_hook())
        trained = self.trainer.train(rc)
        results, rejected = self.screen(trained, t)
        if trained and all(not math.isfinite(r.loss) for r in trained):
            raise Diverged(f"round {t}: local training diverged on every client (training "
                           f"loss NaN/Inf), so the run stopped; {remedy(c)}")
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
            self.state, diag = self.aggregation.aggregate(self.state, rc.broadcast, uploads, t)
            finite = [torch.isfinite(v).all() for v in flatten(self.state).values()
                      if isinstance(v, torch.Tensor) and v.is_floating_point()]
            if finite and not bool(torch.stack(finite).all()):  # one device sync, not one each
                raise Diverged(f"round {t}: the global model became NaN/Inf from finite "
                               f"client updates, so the run stopped; {remedy(c)}")
            record.update(diag)
            record["client_loss"] = float(np.mean([r.loss for r in results]))
        self.aggregation.after_round(record, t)
        if t < cfg.rounds:
            self.stopped = self.aggregation.stop_reason(t + 1)
        view = self.view(record)
        for cb in self.callbacks:
            cb.after_aggregate(view, record, results)
        self.round = t
        if self.evaluating(t):
            view = self.view(record)
            torch.set_num_threads(self.eval_threads)  # the workers wait: their cores are free
            try:
                for cb in self.callbacks:
                    cb.on_evaluate(view, record)
            finally:
                torch.set_num_threads(self.cfg.threads)
            check_loss(record, data.num_classes, c, self.aggregation.noised)
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
        spec = self.aggregation.reply_spec()
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
            "elapsed": self.elapsed, "last": self.last, "torch_rng": self.rng,
            "callbacks": {cb.name: cb.state_dict() for cb in self.callbacks},
            "privacy": self.aggregation.state_dict()})

    def restore(self, snap: dict) -> None:
        self.round, self.state = snap["round"], devices.to_device(snap["state"], self.server)
        self.client_states, self.elapsed = devices.to_host(snap["client_states"]), snap["elapsed"]
        self.last = snap.get("last", {})
        self.rng = snap["torch_rng"]
        for cb in self.callbacks:
            cb.load_state_dict(devices.to_device(snap.get("callbacks", {}).get(cb.name, {}),
                                                 self.server))
        self.aggregation.load_state_dict(snap.get("privacy", {}))

    def resume(self, snap: dict, store: RunStore | None = None) -> None:
        """Continue from the checkpoint ``snap`` of the run folder of ``store`` (default: the
        run's own): restored, after the store has checked that ``metrics.jsonl`` holds every
        evaluated round up to it (and rewritten ``config.json`` when the run was extended)."""
        store = store or self.store
        if self.cfg.rounds < snap["round"]:
            where = store.out if store is not None else "the checkpoint"
            raise ProtoflError(f"rounds = {self.cfg.rounds}: {where} has already run "
                               f"{snap['round']} rounds; give at least that many")
        self.restore(snap)
        if store is not None:
            store.resume(self.cfg.to_dict(), self.round, self.cfg.eval_every,
                              self.cfg.rounds)

    def write_round(self, record: dict) -> None:
        """The run folder's part of a round: its metric line, the checkpoint when due, the
        round's weights (``metrics.save_weights``)."""
        last = self.round if self.stopped else self.cfg.rounds
        due = should_checkpoint(self.round, self.cfg.checkpoint_every, last)
        self.store.round_end(
            record, self.evaluating(record["round"]),
            (lambda: {**self.snapshot(), "algorithm": self.alg.name}) if due else None,
            self.alg.global_weights(self.state) if self.cfg.metrics.save_weights else None,
            trainers.last_choice(self.trainer))

    # ---- the whole run ----
    def run(self) -> dict:
        """Rounds up to ``cfg.rounds`` (from where a restored run stopped); the summary."""
        threads = torch.get_num_threads()
        torch.set_num_threads(self.cfg.threads)
        devices.set_deterministic(self.cfg.deterministic)
        try:
            view = self.view()
            for cb in self.callbacks:
                cb.before_run(view)
            if self.store is not None:
                self.store.start(self.cfg.to_dict(), self.round)
                if self.round:  # resumed: trained as the run was (no plan.jsonl: a folder
                    # of an earlier protofl, whose auto read the constants)
                    trainers.replay(self.trainer, self.store.replay or trainers.Plan())
            for cb in self.callbacks:
                cb.on_run_start(view)
            if self.round < self.cfg.rounds:  # a resumed run that had stopped (a budget)
                self.stopped = self.aggregation.stop_reason(self.round + 1) or (
                    self.callback_stop(view) if self.round else "")
            try:
                while self.round < self.cfg.rounds and not self.stopped:
                    record = self.step()
                    if self.store is not None:
                        self.write_round(record)
                    view = self.view(record)
                    for cb in self.callbacks:
                        cb.on_round_end(view, record)
                    self.stopped = self.stopped or self.callback_stop(view)
            finally:
                self.close()
            summary = self.summary()
            if self.store is not None:
                self.store.finish(summary)
            view = self.view()
            for cb in self.callbacks:
                cb.on_run_end(view, summary)
            return summary
        finally:
            torch.set_num_threads(threads)
            devices.set_deterministic(False)  # the caller's settings back

    def callback_stop(self, view: RoundView) -> str:
        """The first callback's reason to end the run here ("" to go on)."""
        return next((r for cb in self.callbacks if (r := cb.stop_reason(view))), "")

    def close(self) -> None:
        """Release what the trainer holds (the parallel trainer's worker processes)."""
        close = getattr(self.trainer, "close", None)
        if close is not None:
            close()

    def summary(self) -> dict:
        keep = {k: v for k, v in self.last.items()
                if not isinstance(v, list) or k == "confusion"}
        return {"algorithm": self.alg.name, "dataset": self.data.name, "seed": self.cfg.seed,
                "rounds": self.round, "trainer": self.trainer.name,
                **trainers.rounds_by_trainer(self.trainer), "device": str(self.device),
                "seconds": round(self.elapsed, 3), **keep,
                **({"stopped": self.stopped} if self.stopped else {}),
                "provenance": provenance()}


def restored(store: RunStore) -> Experiment:
    """The run of ``store``'s folder rebuilt from its ``config.json`` as it stood at its last
    checkpoint (figures drawn after a run: t-SNE, the segmentation figure), once the folder
    is verified (``RunStore.verify``). Nothing is written."""
    from protofl.config import config_from_dict

    store.verify()
    exp = Experiment(config_from_dict(store.config()))
    exp.restore(store.checkpoint())
    return exp
