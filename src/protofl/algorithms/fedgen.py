"""FedGen (Zhu, Hong & Zhou, ICML 2021, "Data-free knowledge distillation for heterogeneous
federated learning"; HtFLlib's ``FedGen``), in HtFLlib's heterogeneous-model form.

Every client keeps its own body (``capabilities.Personalized``; bodies may differ, sharing
the feature size d) and shares its head ``h(z) = W z + b`` (``classifier.*``), as
``lgfedavg``: a round starts from the client's own body and the global head, and the server
averages the uploaded heads by n_k. Clients also upload their label counts n_k[c].

Server: a conditional generator ``G(eps, y) = W2 relu(BN(W1 [eps, onehot(y)])) + b2``
(eps ~ U[0, 1)^noise_dim, as both reference codes draw it; BatchNorm on batch statistics
while training, on running statistics otherwise; the references' bias before BatchNorm, which
it cancels, is left out: its gradient is 0 and Adam would move it by rounding noise) is trained
each round on the round's uploaded heads h_k for ``server_steps`` Adam steps of
``server_batch`` labels ``y ~ p(y)`` with

    L_G = CE(sum_k a_k[y] h_k(G(eps, y)), y) + eta * exp(-mean_ij ||eps_i - eps_j||^2 |G_i - G_j|_1)

(``teacher: ensemble``: the paper's ensemble of the users' logits, with the authors' per-class
user weights a_k[y] = n_k[y] / sum_k' n_k'[y]; ``teacher: per_client``, the authors'
``serverpFedGen.py``, is ``sum_k a_k[y] CE(h_k(G), y)``; ``ensemble_weights: samples``,
HtFLlib's ``servergen.py``, sets a_k[y] = n_k / sum n). The second term is the authors'
diversity loss (squared and absolute differences averaged over the dimensions). p(y) is
proportional to the round's summed label counts (``labels: counts``; HtFLlib draws labels in
proportion to every client's counts) or uniform over the classes the round's clients hold
(``labels: present``, the authors' qualified labels). Labels, noise and batch order come from a
generator keyed by (the state's seed, SERVER, round); Adam is made afresh each round.

Clients: the server sends, instead of the generator, a bank of generated features
``g[c, m] = G(eps_cm, c)`` (``samples_per_class`` per class, noise from the same generator)
and p(y). Local loss (the authors' ``userpFedGen.py``)

    L = CE(f(x), y) + alpha_t sum_c p(c) mean_m CE(h(g[c, m]), c)
        + beta_t mean_m KL(softmax(h(g[y, m])) || softmax(f(x)))

with the KL target held constant, ``alpha_t = alpha decay^(t-1)`` and ``beta_t`` alike (floor
1e-4, the authors' schedule), both 0 until the server has trained the generator once (round 1).
The bank is protofl's reconstruction: the reference codes draw fresh labels and noise on the
client every step; a fixed bank per round keeps the loss deterministic, so every trainer and
Flower give the same numbers.

Defaults: the authors' MNIST settings (``RUNCONFIGS``/``GENERATORCONFIGS`` of
zhuangdizhu/FedGen): alpha = beta = 10, decay 0.98, eta = 1, Adam lr 3e-4, 50 generator steps
of 32 labels, noise 32, hidden 256; they also keep Adam's state across rounds with weight
decay 1e-2 and an lr decay of 0.98, which protofl does not. HtFLlib's form is ``alpha: 1,
beta: 0, decay: 1, eta: 0, ensemble_weights: samples`` (with its ``-nd 512 -hd 512 -glr 0.005
-se 100`` and its clients' batch 10 as ``server_batch``). The paper's text was not at hand:
the losses are the authors' code's, the teacher's ensemble form the paper's objective as it is
usually stated (unchecked here). Client training: HtFLlib's defaults.

DP and secure sums: the heads and counts are sums over clients, but the default teacher weighs
every client's head by that client's own class counts (or, ``per_client``, scores every head
alone), so the server needs each upload: refused. With ``teacher: ensemble,
ensemble_weights: samples`` the teacher is the n_k-weighted mean head, the global head
itself, so the rule is a ratio of sums and DP (server or client noise) and secure sums run it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from protofl.algorithms.base import Tensors, UploadEntry, forward, weighted_mean
from protofl.algorithms.fedgh import head_logits
from protofl.algorithms.lgfedavg import LGFedAvg, head_of
from protofl.algorithms.optimizers import server_train
from protofl.config import option
from protofl.seeding import SERVER, torch_gen

TEACHERS = ("ensemble", "per_client")
ENSEMBLE_WEIGHTS = ("labels", "samples")
LABELS = ("counts", "present")
BN_EPS, BN_MOMENTUM = 1e-5, 0.1  # torch.nn.BatchNorm1d's defaults
FLOOR = 1e-4  # the authors' floor of the decayed client weights


@dataclass
class FedGenOptions:
    alpha: float = option(10.0, "weight of the CE of the head on generated features (the "
                                "authors' MNIST generative_alpha; HtFLlib: 1)", ge=0)
    beta: float = option(10.0, "weight of the KL of the model's prediction to its head's on "
                               "generated features of the same label (the authors' MNIST "
                               "generative_beta; HtFLlib has no such term: 0)", ge=0)
    decay: float = option(0.98, "per-round factor of alpha and beta (the authors'; HtFLlib: "
                                "1)", gt=0, le=1)
    eta: float = option(1.0, "weight of the generator's diversity loss (the authors' "
                             "ensemble_eta; HtFLlib has none: 0)", ge=0)
    teacher: str = option("ensemble", "the generator's teacher: ensemble (CE of the weighted "
                                      "sum of the clients' logits, the paper's ensemble) or "
                                      "per_client (weighted sum of each head's CE, the authors' "
                                      "code)", choices=TEACHERS)
    ensemble_weights: str = option("labels", "client weights of the teacher: labels (client "
                                             "k's share of class y, the authors') or samples "
                                             "(n_k / n, HtFLlib's)", choices=ENSEMBLE_WEIGHTS)
    labels: str = option("counts", "label distribution p(y) of the generated features: counts "
                                   "(the round's summed label counts) or present (uniform over "
                                   "the classes the round's clients hold, the authors')",
                         choices=LABELS)
    server_steps: int = option(50, "generator steps per round (the authors' 10 x 5; HtFLlib's "
                                   "-se 100)", ge=1)
    server_batch: int = option(32, "labels per generator step (the authors' batch 32; HtFLlib: "
                                   "the clients' batch, 10)", ge=2)
    server_lr: float = option(3e-4, "generator Adam learning rate (the authors' MNIST "
                                    "ensemble_lr; HtFLlib's -glr 0.005)", gt=0)
    noise_dim: int = option(32, "generator noise size (the authors' MNIST; HtFLlib's -nd 512)",
                            ge=1)
    hidden: int = option(256, "generator hidden width (the authors' MNIST; HtFLlib's -hd 512)",
                         ge=1)
    samples_per_class: int = option(10, "generated features per class sent to the clients "
                                        "each round (protofl's bank)", ge=1)


# ---- the generator ----

def init_generator(noise_dim: int, num_classes: int, hidden: int, d: int,
                   gen: torch.Generator) -> tuple[Tensors, Tensors]:
    """Weights (linear layers uniform in +-1/sqrt(fan_in), BatchNorm's scale 1 and shift 0;
    no bias before BatchNorm) and BatchNorm's running statistics (mean 0, variance 1)."""
    def uniform(*shape: int, fan_in: int) -> torch.Tensor:
        return (torch.rand(*shape, generator=gen) * 2 - 1) / math.sqrt(fan_in)

    fan = noise_dim + num_classes
    g = {"w1": uniform(hidden, fan, fan_in=fan), "gamma": torch.ones(hidden),
         "beta": torch.zeros(hidden),
         "w2": uniform(d, hidden, fan_in=hidden), "b2": uniform(d, fan_in=hidden)}
    return g, {"mean": torch.zeros(hidden), "var": torch.ones(hidden)}


def generate(g: Tensors, noise: torch.Tensor, labels: torch.Tensor, num_classes: int,
             running: Tensors, train: bool = False) -> torch.Tensor:
    """``G(noise, labels)`` (n, d). ``train``: BatchNorm on the batch's statistics, which
    update ``running`` in place (torch's momentum and unbiased running variance); else on
    ``running``'s statistics."""
    h = torch.cat([noise, F.one_hot(labels, num_classes).to(noise.dtype)], 1) @ g["w1"].T
    if train:
        mean, var = h.mean(0), h.var(0, unbiased=False)
        with torch.no_grad():
            n = h.shape[0]
            running["mean"].mul_(1 - BN_MOMENTUM).add_(BN_MOMENTUM * mean)
            running["var"].mul_(1 - BN_MOMENTUM).add_(BN_MOMENTUM * var * n / max(n - 1, 1))
    else:
        mean, var = running["mean"], running["var"]
    h = ((h - mean) / torch.sqrt(var + BN_EPS) * g["gamma"] + g["beta"]).relu()
    return torch.addmm(g["b2"], h, g["w2"].T)


def diversity_loss(noise: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The authors' diversity loss ``exp(-mean_ij d_eps(i, j) d_z(i, j))``: d_eps the mean
    squared and d_z the mean absolute difference over the dimensions, every ordered pair."""
    dz = (z.unsqueeze(1) - z.unsqueeze(0)).abs().mean(-1)
    de = (noise.unsqueeze(1) - noise.unsqueeze(0)).pow(2).mean(-1)
    return torch.exp(-(de * dz).mean())


def teacher_loss(model, heads: list[Tensors], weights: torch.Tensor, z: torch.Tensor,
                 y: torch.Tensor, form: str) -> torch.Tensor:
    """The clients' heads ``heads[k]`` as the generator's teacher on features ``z (n, d)`` of
    labels ``y``, client k weighing ``weights[k, y]``: ``ensemble`` CE of the weighted sum of
    the logits, ``per_client`` the weighted sum of each head's CE (means over the rows)."""
    logits = torch.stack([head_logits(model, h, z) for h in heads])  # (K, n, C)
    a = weights[:, y].to(logits.dtype)  # (K, n)
    if form == "ensemble":
        return F.cross_entropy((a.unsqueeze(-1) * logits).sum(0), y)
    k, n = a.shape
    ce = F.cross_entropy(logits.flatten(0, 1), y.repeat(k), reduction="none").view(k, n)
    return (a * ce).sum(0).mean()


def client_weights(counts: torch.Tensor, sizes: torch.Tensor, how: str) -> torch.Tensor:
    """``a (K, C)``: each client's share of class c's samples (``labels``; 0 for a class nobody
    holds) or of all samples (``samples``)."""
    if how == "samples":
        return (sizes / sizes.sum()).unsqueeze(1).expand_as(counts).to(counts.dtype)
    total = counts.sum(0, keepdim=True)
    return torch.where(total > 0, counts / total.clamp_min(1e-12), torch.zeros_like(counts))


def label_probs(counts: torch.Tensor, how: str) -> torch.Tensor:
    """p(y) from the round's summed label counts ``(C,)`` (all zero when there are none)."""
    p = counts.clamp_min(0) if how == "counts" else (counts > 0).to(counts.dtype)
    return p / p.sum() if p.sum() > 0 else torch.zeros_like(p)


def train_generator(model, g: Tensors, running: Tensors, heads: list[Tensors],
                    weights: torch.Tensor, probs: torch.Tensor, opts: FedGenOptions,
                    num_classes: int, gen: torch.Generator
                    ) -> tuple[Tensors, Tensors, list[float]]:
    """``server_steps`` Adam steps on L_G, each on ``server_batch`` fresh labels ~ ``probs``
    and noise drawn from ``gen``: new weights, running statistics and the steps' mean loss."""
    n = opts.server_steps * opts.server_batch
    device = g["w1"].device
    labels = torch.multinomial(probs.cpu().double(), n, replacement=True, generator=gen)
    noise = torch.rand(n, opts.noise_dim, generator=gen)
    labels, noise = labels.to(device), noise.to(device=device, dtype=g["w1"].dtype)
    stats = {k: v.clone() for k, v in running.items()}

    def loss(w: Tensors, idx: torch.Tensor) -> torch.Tensor:
        idx = idx.to(device)
        z = generate(w, noise[idx], labels[idx], num_classes, stats, train=True)
        value = teacher_loss(model, heads, weights, z, labels[idx], opts.teacher)
        return value + opts.eta * diversity_loss(noise[idx], z) if opts.eta else value

    # one pass over n fresh rows = server_steps steps (the order is drawn from gen too)
    new, history = server_train(g, loss, n, 1, opts.server_batch, opts.server_lr, gen, "adam")
    return new, stats, history


def feature_bank(g: Tensors, running: Tensors, num_classes: int, per_class: int,
                 noise_dim: int, gen: torch.Generator) -> torch.Tensor:
    """``(C, M, d)``: M generated features of every class (evaluation-mode BatchNorm)."""
    labels = torch.arange(num_classes).repeat_interleave(per_class).to(g["w1"].device)
    noise = torch.rand(len(labels), noise_dim, generator=gen).to(g["w1"])
    with torch.no_grad():
        z = generate(g, noise, labels, num_classes, running)
    return z.view(num_classes, per_class, -1)


def schedule(weight: float, decay: float, rounds: int) -> float:
    """``weight decay^rounds``, floored at 1e-4 (never above ``weight``)."""
    return max(weight * decay ** rounds, min(weight, FLOOR))


class FedGen(LGFedAvg):
    name = "fedgen"
    description = ("FedGen (Zhu et al. 2021): own bodies, heads averaged; a server generator "
                   "of features the clients' head ensemble labels, which regularises the heads")
    Options = FedGenOptions
    client_defaults_source = ("HtFLlib (main.py defaults, which its FedGen uses): SGD, "
                              "lr 0.01, batch 10, E = 1")

    def server_bytes(self):
        """A round's generator draws its labels (and their order) and noise at once; the key
        named is the factor furthest above its default."""
        o = self.opts
        n = o.server_steps * o.server_batch
        factors = {k: getattr(o, k) / getattr(FedGenOptions, k)
                   for k in ("server_steps", "server_batch", "noise_dim")}
        key = max(factors, key=factors.get)
        return [(f"algo.{key}", getattr(o, key), n * (8 + 8 + 4 * o.noise_dim),
                 f"the generator's round of {o.server_steps} steps x {o.server_batch} labels "
                 f"with noise of {o.noise_dim} values each (labels, their order and noise; "
                 "lower algo.server_steps, algo.server_batch or algo.noise_dim)")]

    # ---- privacy ----
    def sums_exact(self) -> bool:
        """Whether the server rule is a ratio of sums (the teacher is the mean head)."""
        return self.opts.teacher == "ensemble" and self.opts.ensemble_weights == "samples"

    def sums_reason(self):
        if self.opts.teacher == "per_client":
            return ("its generator's teacher scores every client's head alone "
                    "(algo.teacher: ensemble with algo.ensemble_weights: samples is a ratio of "
                    "sums)")
        if not self.sums_exact():
            return ("its generator's teacher weighs each client's head by that client's own "
                    "label counts (algo.ensemble_weights: samples is a ratio of sums)")
        return super().sums_reason()

    # ---- server ----
    def init_state(self, model):
        state = super().init_state(model)
        seed = int(torch.randint(0, 2**31 - 1, (), device="cpu"))  # the run's seeded RNG
        o, c, d = self.opts, self.num_classes, model.feature_dim
        g, running = init_generator(o.noise_dim, c, o.hidden, d, torch_gen(seed, SERVER, 0))
        state.update(generator=g, running=running, seed=torch.tensor(seed),
                     bank=torch.zeros(c, o.samples_per_class, d), label_probs=torch.zeros(c),
                     alpha=torch.tensor(0.0), beta=torch.tensor(0.0))
        return state

    def broadcast(self, state):
        return {**super().broadcast(state),
                **{k: state[k] for k in ("bank", "label_probs", "alpha", "beta")}}

    def aggregate(self, state, uploads, round):
        new, diag = super().aggregate(state, uploads, round)  # the global head
        counts = torch.stack([u["counts"] for u in uploads]).to(torch.float32)  # (K, C)
        sizes = torch.stack([u["num_samples"] for u in uploads]).to(torch.float64)
        probs = label_probs(counts.sum(0), self.opts.labels)
        diag["classes"] = (counts > 0).sum(0).tolist()
        if probs.sum() == 0:  # no label to generate (e.g. every count below a DP threshold)
            return new, diag
        o, c = self.opts, self.num_classes
        gen = torch_gen(int(state["seed"]), SERVER, round)
        heads = [u[self.key] for u in uploads]
        weights = client_weights(counts, sizes, o.ensemble_weights)
        g, running, history = train_generator(self.model, state["generator"], state["running"],
                                               heads, weights, probs, o, c, gen)
        new.update(generator=g, running=running, label_probs=probs.to(state["label_probs"]),
                   bank=feature_bank(g, running, c, o.samples_per_class, o.noise_dim, gen),
                   alpha=torch.full_like(state["alpha"], schedule(o.alpha, o.decay, round)),
                   beta=torch.full_like(state["beta"], schedule(o.beta, o.decay, round)))
        diag["server_loss"] = history[-1]
        return new, diag

    # ---- client ----
    def client_begin(self, c):
        return {k: c.broadcast[k] for k in ("bank", "label_probs", "alpha", "beta")}

    def loss(self, model, params, buffers, x, y, w, ctx):
        _, logits = forward(model, params, buffers, x)
        bank = ctx["bank"]  # (C, M, d)
        c, m = bank.shape[0], bank.shape[1]
        gen_logits = head_logits(model, head_of(params, self.shared),
                                 bank.flatten(0, 1)).view(c, m, -1)
        classes = torch.arange(c, device=bank.device)
        gen_ce = F.cross_entropy(gen_logits.flatten(0, 1), classes.repeat_interleave(m),
                                 reduction="none").view(c, m).mean(1)
        target = F.softmax(gen_logits.detach(), -1)[y]  # (B, M, C): the head's on g[y, m]
        log_p = F.log_softmax(logits, -1).unsqueeze(1)
        kl = (torch.xlogy(target, target) - target * log_p).sum(-1).mean(1)
        ce = F.cross_entropy(logits, y, reduction="none")
        return (weighted_mean(ce + ctx["beta"] * kl, w)
                + ctx["alpha"] * (ctx["label_probs"].to(gen_ce.dtype) * gen_ce).sum())

    def client_end(self, t):
        up, own = super().client_end(t)
        up["counts"] = torch.bincount(t.y.reshape(-1).long(),
                                      minlength=self.num_classes).to(torch.float32)
        return up, own

    def upload_spec(self):
        spec = super().upload_spec()
        kind = "counts" if self.sums_exact() else "other"
        spec["counts"] = UploadEntry((self.num_classes,), count=True, kind=kind)
        return spec
