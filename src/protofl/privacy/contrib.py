"""Uploads as sums: what one client contributes to a round, and the aggregate the server
rebuilds from the sum of the contributions (client-level DP, secure aggregation).

An algorithm's server rule is a function of sums over clients when its upload entries are
weights, prototypes with their counts, sizes and client-computed weights
(``UploadEntry.kind``) and a client's aggregation weight w_k depends on that client alone
(``capabilities.Sums.client_weight``). Client k then contributes

- ``delta``: w_k (W_k - W^t) over the floating-point weights entries; under DP the update is
  clipped to norm C first (``clip``) and w_k is bounded (``client_weight_bound``) or, if it is
  unbounded like n_k, replaced by 1 with the fixed denominator K';
- ``weight``: w_k;
- ``proto.<key>`` and ``count.<counts key>`` for each prototypes entry: n_k[c] p_k[c] and
  n_k[c] (1[n_k[c] > 0] for ``presence`` counts); under DP the fraction-weighted clipped
  prototypes and the class fractions of ``clip_prototypes``;
- ``members``: 1 (the sum counts the contributions);

and the server turns the (noised) sum back into one upload-shaped estimate
(:meth:`SumForm.estimate`): W^t + sum delta / sum weight (or / K'), each prototype row
sum proto / sum count where the summed count exceeds a threshold (else 0, so the algorithm
keeps its previous prototype), its count the summed count, sizes and client weights 1. The
algorithm's ``aggregate_private`` makes the next state from that estimate.

Without DP these sums reproduce every such rule exactly (FedAvg's n_k weights, fedmargin's
attention, count- and influence-weighted prototypes); with DP each part of the sum carries
Gaussian noise of std sigma times the part's L2 bound, added by the server to the sum or, as
K' shares of std sigma bound / sqrt(K'), by the clients.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from protofl.algorithms.base import Algorithm, Tensors, UploadEntry
from protofl.algorithms.capabilities import Sums
from protofl.errors import ProtoflError
from protofl.nested import flatten, unflatten
from protofl.privacy.clip import class_fractions, clip, clip_prototypes, l2_norm
from protofl.privacy.noise import (
    NoiseSource,
    client_noise_std,
    distributed_multiplier,
    effective_multiplier,
    gaussian,
)

F64 = torch.float64
DP_THRESHOLD = 2.0  # a noised count sum counts when above this many noise stds


@dataclass(frozen=True)
class SumSettings:
    """How uploads become sums: with client-level DP (``multiplier`` > 0) or exact."""

    multiplier: float = 0.0  # sigma, noise std over the L2 bound; 0: exact sums
    clip: float = 1.0  # C, bound on the weights update
    proto_clip: float = 10.0  # C_p, bound on each prototype row
    clients: int = 1  # K': the fixed denominator and the number of noise shares
    client_noise: bool = False  # the clients add the noise (shares), not the server
    scale: float = 1.0  # exact sums: sizes and counts divided by this (fits a secure range)
    delta_multiplier: float | None = None  # the weights update's own sigma (None: multiplier)

    @property
    def private(self) -> bool:
        return self.multiplier > 0


class SumForm:
    """One algorithm's uploads as contributions, and the estimate from their sum.

    ``template`` is the flattened broadcast of the run (weights entries must be in it: the
    update is taken against it, and its dtypes are the estimate's).
    """

    def __init__(self, alg: Algorithm | Sums, template: dict[str, Tensor],
                 settings: SumSettings):
        self.alg, self.settings = alg, settings
        self.upload_spec = spec = alg.upload_spec()
        weights = [k for k, e in spec.items() if e.kind == "weights"]
        missing = [k for k in weights if k not in template]
        if missing:
            raise ValueError(f"{alg.name}: weights entry {missing[0]!r} is not broadcast")
        self.weights = [k for k in weights if template[k].is_floating_point()]
        self.fixed = [k for k in weights if not template[k].is_floating_point()]
        self.protos = {k: e.weighed_by for k, e in spec.items() if e.kind == "prototypes"}
        for key, by in self.protos.items():
            if spec.get(by, UploadEntry(())).kind not in ("counts", "presence"):
                raise ValueError(f"{alg.name}: prototypes {key!r} are weighed by {by!r}, "
                                 "which is no counts entry")
        self.counts = [k for k, e in spec.items() if e.kind in ("counts", "presence")]
        self.ones = [k for k, e in spec.items() if e.kind in ("size", "weight")]
        self.dtypes = {k: template[k].dtype if k in template else (
            F64 if spec[k].kind in ("size", "weight") else torch.get_default_dtype())
            for k in spec}
        bound = alg.client_weight_bound()
        self.bounded = bound is not None
        self.uniform = settings.private and not self.bounded  # DP: w_k = 1, denominator K'
        self.weight_bound = float(bound) if self.bounded else 1.0

    def adjusted(self, **settings) -> SumForm:
        """This form with some settings replaced (a round's clip norm and the update's noise
        multiplier under adaptive clipping); the original is unchanged."""
        out = copy.copy(self)
        out.settings = replace(self.settings, **settings)
        return out

    # ---- what a client sends ----
    def update_norm(self, upload: Tensors, broadcast: Tensors) -> float:
        """The L2 norm of the client's weights update W_k - W^t, before any clipping."""
        flat, base = flatten(upload), flatten(broadcast)
        return l2_norm({k: flat[k].to(F64) - base[k].to(F64) for k in self.weights})

    def weight(self, upload: Tensors, state: Tensors | None) -> Tensor:
        """w_k: the algorithm's client weight (DP: bounded, or 1 when unbounded; exact sums:
        an unbounded weight divided by ``scale``)."""
        if self.uniform:
            return torch.tensor(1.0, dtype=F64)
        w = self.alg.client_weight(upload, state).to(F64)
        if self.settings.private:
            return w.clamp(0.0, self.weight_bound)
        return w if self.bounded else w / self.settings.scale

    def contribution(self, upload: Tensors, broadcast: Tensors, state: Tensors | None = None,
                     gen: NoiseSource = None) -> tuple[Tensors, float]:
        """Client k's contribution (with its share of the noise when the clients add it) and
        the norm of its weights update before clipping (0 without weights)."""
        s, flat, base = self.settings, flatten(upload), flatten(broadcast)
        out: Tensors = {}
        norm = 0.0
        if self.weights:
            w = self.weight(upload, state)
            delta = {k: flat[k].to(F64) - base[k].to(F64) for k in self.weights}
            norm = l2_norm(delta)
            if s.private:
                delta, _ = clip(delta, s.clip)
            out["delta"] = {k: w * v for k, v in delta.items()}
            out["weight"] = w
        if self.counts:
            out["count"] = {k: self.weighing(k, flat[k]) for k in self.counts}
        if self.protos:
            out["proto"] = {}
        for key, by in self.protos.items():
            p, n = flat[key].to(F64), flat[by].to(F64)
            if s.private:
                out["proto"][key] = clip_prototypes(p, n, s.proto_clip)[0]
            else:
                out["proto"][key] = out["count"][by].unsqueeze(-1) * p
        out["members"] = torch.tensor(1.0, dtype=F64)
        if s.private and s.client_noise:
            out = self.noised(out, gen, shares=s.clients)
        return out, norm

    def weighing(self, key: str, counts: Tensor) -> Tensor:
        """What counts entry ``key`` contributes: the fractions n / sum n under DP (L2 norm
        <= 1, as in ``clip_prototypes``), else n (1[n > 0] for presence) divided by
        ``scale``."""
        if self.settings.private:
            return class_fractions(counts.to(F64))
        n = counts.to(F64).clamp_min(0)
        if self.upload_spec[key].kind == "presence":
            n = (n > 0).to(F64)
        return n / self.settings.scale

    def spec(self) -> dict[str, UploadEntry]:
        """The shapes of a valid contribution (flattened keys), to screen clients' replies."""
        noisy = self.settings.private and self.settings.client_noise
        out = {f"delta.{k}": UploadEntry(self.upload_spec[k].shape) for k in self.weights}
        if self.weights:
            out["weight"] = UploadEntry((), count=not noisy)
        for key in self.counts:
            out[f"count.{key}"] = UploadEntry(self.upload_spec[key].shape, count=not noisy)
        for key in self.protos:
            out[f"proto.{key}"] = UploadEntry(self.upload_spec[key].shape)
        out["members"] = UploadEntry((), count=True)
        return out

    # ---- noise ----
    def bounds(self) -> dict[str, float]:
        """The L2 bound of each noised part of a contribution (DP); the delta's bound is the
        update's C times the largest client weight."""
        s, out = self.settings, {}
        if self.weights:
            out["delta"] = self.weight_bound * s.clip
            if not self.uniform:
                out["weight"] = self.weight_bound
        out.update({f"count.{k}": 1.0 for k in self.counts})
        out.update({f"proto.{k}": s.proto_clip for k in self.protos})
        return out

    def noised(self, tree: Tensors, gen: NoiseSource, shares: int = 1) -> Tensors:
        """``tree`` plus N(0, (sigma * bound)^2 / shares) on every entry of every noised part
        (``shares`` = K': one client's share of the noise), drawn from ``gen``
        (``privacy.noise.noise_source``)."""
        sigma, out = self.settings.multiplier, dict(tree)

        def noisy(v: Tensor, std: float) -> Tensor:  # drawn on the CPU: the same on any device
            return v + std * gaussian(v.shape, v.dtype, gen).to(v.device)

        for part, bound in self.bounds().items():
            top, _, key = part.partition(".")
            std = client_noise_std(bound, self.part_sigma(part, sigma), shares)
            if top == "delta":
                out[top] = {k: noisy(v, std) for k, v in tree[top].items()}
            elif key:
                out[top] = {**out[top], key: noisy(tree[top][key], std)}
            else:
                out[top] = noisy(tree[top], std)
        return out

    def part_sigma(self, part: str, sigma: float) -> float:
        """The noise multiplier of one noised part: the update's own (adaptive clipping) for
        ``delta``, else ``sigma``."""
        d = self.settings.delta_multiplier
        return d if part == "delta" and d is not None else sigma

    def part_multipliers(self, received: float | None = None) -> list[float]:
        """The noise multiplier of each noised part of one round's release (noise std over
        the part's L2 bound); with client-side noise and ``received`` of the K' shares, each
        times sqrt(received / K'). Empty without DP."""
        s = self.settings
        if not s.private:
            return []
        out = []
        for part in self.bounds():
            sigma = self.part_sigma(part, s.multiplier)
            if s.client_noise and received is not None:
                sigma = distributed_multiplier(sigma, s.clients, min(received, s.clients))
            out.append(sigma)
        return out

    def multiplier(self, received: float | None = None) -> float:
        """The noise multiplier of one round's release for the accountant: the parts'
        multipliers combined (``effective_multiplier``); with client-side noise and
        ``received`` of the K' shares, sigma sqrt(received / K')."""
        return effective_multiplier(self.part_multipliers(received))

    # ---- what the server makes of the sum ----
    @staticmethod
    def total(contributions: list[Tensors]) -> Tensors:
        """The entrywise sum of contributions (as trees)."""
        flats = [flatten(c) for c in contributions]
        return unflatten({k: sum(f[k] for f in flats) for k in flats[0]})

    def estimate(self, total: Tensors, broadcast: Tensors) -> Tensors:
        """One upload-shaped estimate of the round's aggregate from the (noised) sum."""
        s, base = self.settings, flatten(broadcast)
        est: dict[str, Tensor] = {}
        if self.weights:
            if self.uniform:
                denom = float(s.clients)
            else:
                floor = self.weight_bound if s.private else 1e-300
                denom = max(float(total["weight"]), floor)
            for k in self.weights:
                est[k] = (base[k].to(F64) + total["delta"][k] / denom).to(self.dtypes[k])
        for k in self.fixed:
            est[k] = base[k].clone()
        threshold = DP_THRESHOLD * s.multiplier if s.private else 0.5 / s.scale
        for key in self.counts:
            n = total["count"][key]
            est[key] = torch.where(n > threshold, n if s.private else n * s.scale,
                                   torch.zeros_like(n)).to(self.dtypes[key])
        for key, by in self.protos.items():
            n = total["count"][by]
            ok = n > threshold
            safe = torch.where(ok, n, torch.ones_like(n)).unsqueeze(-1)
            est[key] = torch.where(ok.unsqueeze(-1), total["proto"][key] / safe,
                                   torch.zeros_like(total["proto"][key])).to(self.dtypes[key])
        device = next(iter(base.values())).device if base else None
        for k in self.ones:
            est[k] = torch.tensor(1.0, dtype=self.dtypes[k], device=device)
        return unflatten(est)


def check_secure_range(contribution: Tensors, names, reach: float, client: int) -> None:
    """SecAgg+ quantizes every contribution entry within ±``privacy.secagg_range``: a
    client refuses to send one outside it (or non-finite), in the simulator as on Flower."""
    flat = flatten(contribution)
    for name in names:
        a = flat[name].detach().to("cpu", F64)
        top = float(a.abs().max()) if a.numel() else 0.0
        if not bool(torch.isfinite(a).all()) or top > reach:
            top = top if bool(torch.isfinite(a).all()) else float("nan")
            raise ProtoflError(f"client {client}: contribution {name!r} reaches {top:.4g}, "
                               f"outside privacy.secagg_range = {reach:g}; raise it")
