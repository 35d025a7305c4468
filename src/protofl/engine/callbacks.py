"""Round callbacks: everything the round loop does besides training, aggregating and writing
the run folder (that is the loop's :class:`~protofl.engine.runfolder.RunStore`).

A callback overrides the hooks it needs; the loop calls them in list order::

    before_run(view)                        before the run folder is touched (also on
                                            resume): open what the callback needs, refuse
                                            what it cannot do, write nothing
    on_run_start(view)                      before the first round, once the store has
                                            prepared the run folder (also on resume)
    after_aggregate(view, record, results)  every round, after aggregation (timed)
    on_evaluate(view, record)               on evaluation rounds (timed)
    on_round_end(view, record)              every round, after ``seconds`` is set and the
                                            run folder has the round
    on_run_end(view, summary)               after the last round and the summary

``view`` is a read-only :class:`RoundView` of the run (its spec, data, algorithm, state,
client states, round, the round's record and the run folder's store), never the loop itself:
a callback cannot restore, step or rewire a run. ``record`` is the round's line of
``metrics.jsonl`` (a dict callbacks add figures to), ``results`` the round's
``ClientResult``s. A callback with state returns it from ``state_dict`` (checkpointed) and
takes it back in ``load_state_dict``.

The metrics (:class:`TestMetrics`, :class:`TrainLoss`, :class:`Dissimilarity`, :class:`Amm`)
and the progress bar (:class:`Progress`) are callbacks; a user adds one from Python
(``protofl.run(cfg, callbacks=[...])``) or from the config (``callbacks:
["my_module:MyCallback"]``, built with no arguments).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from protofl import device as devices
from protofl import plugins
from protofl.algorithms import capabilities, prototype_math
from protofl.algorithms.capabilities import personalized
from protofl.engine import hetero, reference
from protofl.errors import ProtoflError
from protofl.metrics import federated as fm
from protofl.metrics.mmd import mean_client_mmd
from protofl.seeding import PROBE, np_rng

if TYPE_CHECKING:
    from protofl.algorithms.base import Algorithm
    from protofl.data.federated import FederatedData
    from protofl.engine.runfolder import RunStore
    from protofl.engine.spec import RunSpec
    from protofl.engine.train import ClientResult


@dataclass(frozen=True)
class RoundView:
    """What a callback may see of a run, at one hook: read, never assign (the fields are
    frozen; the tensors are the run's own, so a callback that changed them in place would
    change the run: don't).

    ``spec`` (also ``cfg``) is the resolved spec, ``data`` the federation the metrics score,
    ``alg`` the algorithm (its model, its capabilities), ``state`` the server state after
    this round, ``client_states`` the per-client states the server holds, ``round`` the
    rounds done, ``record`` the round's record (None outside a round), ``individual``
    whether the round's results are the clients' own uploads (not contributions to a sum),
    ``private`` whether the run is differentially private, ``stopped`` why the run ends
    early (or ""), ``store`` the run folder's :class:`RunStore` (None without a folder),
    ``reply_spec`` what a valid client reply holds (an upload, or under privacy layers a
    contribution), ``validation`` the held-out rows as local test splits (None without
    ``data.validation_fraction``).
    """

    spec: RunSpec
    data: FederatedData
    alg: Algorithm
    state: Mapping[str, Any]
    client_states: Mapping[int, dict]
    round: int
    device: Any
    record: dict | None = None
    individual: bool = True
    private: bool = False
    stopped: str = ""
    store: RunStore | None = None
    reply_spec: Mapping[str, Any] = field(default_factory=dict, repr=False)
    inputs: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = field(
        default=None, repr=False)
    validation: FederatedData | None = field(default=None, repr=False)

    @classmethod
    def of(cls, spec, data, alg, state, client_states, round, device, record, aggregation,
           stopped, store, inputs, validation=None) -> RoundView:
        """The view of a run whose aggregation stack is ``aggregation`` (what a callback may
        know of it: whether replies are individual uploads, whether it is private, the reply
        spec)."""
        return cls(spec, data, alg, state, client_states, round, device, record,
                   aggregation.individual, aggregation.private, stopped, store,
                   aggregation.reply_spec(), inputs, validation)

    @property
    def cfg(self) -> RunSpec:
        return self.spec

    def evaluating(self, round: int) -> bool:
        """Whether round ``round`` is evaluated (``eval_every``, the last, an early stop)."""
        return (round % self.spec.eval_every == 0 or round == self.spec.rounds
                or bool(self.stopped))

    def client_inputs(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Client ``k``'s training rows ``x, y`` (loaded only if asked)."""
        return self.inputs(k)

    def autocast(self):
        """The run's precision for forward passes (evaluation, metrics)."""
        return devices.autocast(self.device, self.spec.precision)


class Callback:
    """A hook into the round loop (every hook does nothing by default)."""

    @property
    def name(self) -> str:
        return type(self).__name__

    def before_run(self, view: RoundView) -> None:
        pass

    def on_run_start(self, view: RoundView) -> None:
        pass

    def after_aggregate(self, view: RoundView, record: dict, results: list[ClientResult]
                        ) -> None:
        pass

    def on_evaluate(self, view: RoundView, record: dict) -> None:
        pass

    def on_round_end(self, view: RoundView, record: dict) -> None:
        pass

    def stop_reason(self, view: RoundView) -> str:
        """Why the run should end after this round ("" to go on): asked after
        ``on_round_end`` (early stopping, a test's budget)."""
        return ""

    def on_run_end(self, view: RoundView, summary: dict) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


# ---- per-round metrics ----

class Amm(Callback):
    """The aggregate mean margin: SPM of each client's prototypes against the count-weighted
    aggregate of the prototypes seen so far, over the classes some client has reported
    (``metrics.amm``). A client whose prototypes count
    no sample is left out: its upload holds none and its data are not here (a Flower site),
    so an algorithm that uploads weights only has no AMM in site mode."""

    def __init__(self) -> None:
        self.reference: torch.Tensor | None = None  # aggregate prototypes (C, d)
        self.reported: torch.Tensor | None = None  # (C,) classes some client has reported

    def after_aggregate(self, exp, record, results):
        if not exp.cfg.metrics.amm or not results or not exp.individual:
            return  # (contributions to a sum hold no one client's prototypes)
        pairs = [capabilities.prototypes(exp.alg, r.upload,
                                         functools.partial(exp.client_inputs, r.client))
                 for r in results]
        pairs = [(p, n) for p, n in pairs if bool((n > 0).any())]
        if not pairs:
            return
        protos, counts = torch.stack([p for p, _ in pairs]), torch.stack([n for _, n in pairs])
        previous = self.reference if self.reference is not None else torch.zeros_like(protos[0])
        self.reference = prototype_math.aggregate_prototypes(protos, counts, previous)
        seen = (counts > 0).any(0)
        self.reported = seen if self.reported is None else self.reported | seen
        record["amm"] = fm.aggregate_mean_margin(protos, counts, self.reference, self.reported)

    def state_dict(self):
        return {} if self.reference is None else {"reference": self.reference,
                                                  "reported": self.reported}

    def load_state_dict(self, state):
        self.reference, self.reported = state.get("reference"), state.get("reported")


class TestMetrics(Callback):
    """Accuracy, loss and the classification report of the aggregate model on the global test
    set, and each client's accuracy on its local test split (personalised methods: with its
    own model, all clients' predictions pooled into the report). Scoring every client's
    split is work over all K clients: with an aggregate model it is done at the costly
    figures' rounds (``metrics.every``, and the last); a personalised method's figures are
    its clients', so every evaluated round."""

    def on_evaluate(self, exp, record):
        alg, data, state = exp.alg, exp.data, exp.state
        batch = exp.cfg.metrics.eval_batch
        weights = alg.global_weights(state)
        own = weights is None or personalized(alg)
        with exp.autocast():
            if weights is not None:
                record.update(fm.evaluate(alg, alg.model, weights["params"], weights["buffers"],
                                          state, data.x_test, data.y_test, data.num_classes,
                                          batch, data.inputs, data.class_names))
            if not (own or costly_due(exp, record)):
                return
            preds = hetero.client_predictions(alg, state, data, exp.client_states, batch)
        record.update(fm.client_figures(preds, data.num_classes, pooled=personalized(alg)))


class EarlyStop(Callback):
    """With a validation split (``data.validation_fraction``): ``validation_accuracy`` on
    evaluated rounds, every client's held-out training rows scored as its local test split
    is, pooled. With ``metrics.early_stop`` = N the run stops after N evaluated rounds
    without a new best; its summary's ``stopped`` names the best round (the figures are the
    last round's, as in every run)."""

    def __init__(self) -> None:
        self.best, self.best_round, self.waited = -1.0, 0, 0

    def before_run(self, exp):
        v = exp.validation
        if exp.cfg.metrics.early_stop and (v is None or not len(v.y_local_test)):
            raise ProtoflError("metrics.early_stop: this server holds no validation rows (a "
                               "Flower site federation's data stay at the sites)")

    def on_evaluate(self, exp, record):
        if exp.validation is None:
            return
        with exp.autocast():
            preds = hetero.client_predictions(exp.alg, exp.state, exp.validation,
                                              exp.client_states, exp.cfg.metrics.eval_batch)
        acc = fm.client_figures(preds, exp.data.num_classes, pooled=True).get("accuracy")
        if acc is None:  # no client holds validation rows (or has a model yet)
            return
        record["validation_accuracy"] = acc
        if acc > self.best:
            self.best, self.best_round, self.waited = acc, record["round"], 0
        else:
            self.waited += 1

    def stop_reason(self, exp):
        n = exp.cfg.metrics.early_stop
        if not n or self.waited < n:
            return ""
        return (f"early stopping: no better validation accuracy in {n} evaluated rounds "
                f"(best {self.best:.4f}, round {self.best_round})")

    def state_dict(self):
        return {"best": self.best, "best_round": self.best_round, "waited": self.waited}

    def load_state_dict(self, state):
        self.best = state.get("best", -1.0)
        self.best_round, self.waited = state.get("best_round", 0), state.get("waited", 0)


def costly_due(exp: RoundView, record: dict) -> bool:
    """Whether this evaluated round computes the costly figures (``metrics.every``)."""
    return fm.expensive_due(record["round"], exp.cfg.metrics.every, exp.cfg.rounds)


class TrainLoss(Callback):
    """Cross-entropy of the aggregate model on a seeded sample of the training rows
    (``metrics.train_loss_samples``; 0: off), every ``metrics.every`` rounds; none where the
    training data are not (a Flower site federation's server)."""

    def on_evaluate(self, exp, record):
        n = exp.cfg.metrics.train_loss_samples
        if not n or not costly_due(exp, record) or exp.alg.global_weights(exp.state) is None:
            return
        with exp.autocast():
            loss = fm.train_loss(exp.alg, exp.alg.model, exp.state, exp.data, n, exp.cfg.seed,
                                 exp.cfg.metrics.eval_batch)
        if loss is not None:
            record["train_loss"] = loss


class Dissimilarity(Callback):
    """Gradient dissimilarity of the aggregate model, every ``metrics.every`` rounds: an
    estimate over a fixed seeded sample of probe clients (``metrics.dissimilarity_clients``)
    and their first rows (``metrics.dissimilarity_rows``), or with
    ``metrics.dissimilarity_exact`` the figure over every client and all its rows. 0 for
    either size switches it off; none where the training data are not."""

    def on_evaluate(self, exp, record):
        m = exp.cfg.metrics
        if not len(exp.data.y_train):
            return
        weights = exp.alg.global_weights(exp.state)
        if not (m.dissimilarity_clients and m.dissimilarity_rows) or weights is None or (
                not costly_due(exp, record)):
            return
        k = exp.data.num_clients
        if m.dissimilarity_exact:
            clients, rows = np.arange(k), None
        else:
            n = min(m.dissimilarity_clients, k)
            clients = np.sort(np_rng(exp.cfg.seed, PROBE).choice(k, n, replace=False))
            rows = m.dissimilarity_rows
        value = fm.gradient_dissimilarity(exp.alg.model, weights["params"], weights["buffers"],
                                          exp.data, clients, rows)
        if value is not None:
            record["dissimilarity"] = value


class FeatureFidelity(Callback):
    """``mmd``: on evaluated rounds, MMD² between the features of each active client's model
    and those of the reference run's model of the same round (``metrics.ffd_reference``), on
    a fixed probe of the global test set, averaged over the round's clients. A client's model
    is its upload's weights (``Algorithm.client_weights``), or for personalised methods the
    model it keeps. ``protofl compare`` turns ``mmd`` into FFD against fedavg."""

    def __init__(self) -> None:
        self.ref: reference.Reference | None = None
        self.probe: torch.Tensor | None = None

    def before_run(self, exp):
        m = exp.cfg.metrics
        if m.ffd_reference:
            self.ref = reference.Reference(Path(m.ffd_reference), exp.cfg, exp.alg.model,
                                           exp.data)
            self.probe = reference.probe(exp.data, m.ffd_probe, exp.cfg.data.seed)

    def after_aggregate(self, exp, record, results):
        if self.ref is None or not results or not exp.evaluating(record["round"]):
            return
        alg, m = exp.alg, exp.cfg.metrics
        models = []
        for r in results:
            w = alg.client_weights(r.upload)
            if w is None:
                w = alg.eval_weights(exp.state, exp.client_states.get(r.client, {}))
            if w is not None:
                models.append((w["params"], w["buffers"]))
        if models:
            ref = self.ref.weights(record["round"])
            record["mmd"] = mean_client_mmd(
                alg.model, models, (self.ref.model, ref["params"], ref["buffers"]),
                self.probe, m.ffd_estimator, m.ffd_rows, m.eval_batch)


def metric_callbacks() -> list[Callback]:
    """The per-round metrics every run logs (each switched by its ``metrics.*`` key)."""
    return [Amm(), TestMetrics(), TrainLoss(), Dissimilarity(), FeatureFidelity(), EarlyStop()]


# ---- progress ----

class Progress(Callback):
    """A tqdm progress bar over rounds, showing the last accuracy."""

    def __init__(self) -> None:
        self.bar: Any = None

    def on_run_start(self, exp):
        from tqdm import tqdm

        self.bar = tqdm(total=exp.cfg.rounds, initial=exp.round, unit="round", leave=False,
                        desc=f"{exp.alg.name} {exp.data.name} seed {exp.cfg.seed}")

    def on_round_end(self, exp, record):
        self.bar.update(1)
        if "accuracy" in record:
            self.bar.set_postfix(acc=f"{record['accuracy']:.3f}")

    def on_run_end(self, exp, summary):
        self.bar.close()


def load_callback(path: str) -> Callback:
    """A callback from its ``module:Class`` import path or the name of an installed entry point
    (``protofl.callbacks``), built with no arguments."""
    if path not in plugins.entry_points("callback") and not plugins.is_path(path):
        raise ProtoflError(f"config: callbacks: {path!r} is neither an import path "
                           "package.module:Class nor an installed callback")
    try:
        cls = plugins.load("callback", path, {})
    except ProtoflError as e:
        raise ProtoflError(f"config: callbacks: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, Callback)):
        raise ProtoflError(f"config: callbacks: {path!r} is not a protofl Callback")
    try:
        return cls()
    except TypeError as e:  # it needs arguments
        raise ProtoflError(f"config: callbacks: {path!r} cannot be built with no arguments "
                           f"({e})") from None
