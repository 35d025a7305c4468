"""Adaptive clipping (Andrew et al., NeurIPS 2021) as one privacy layer: its update by hand,
the updates' noise multiplier that keeps each round's privacy, the accounting of its extra
release, a run that resumes exactly, and the one-line refusals."""

from __future__ import annotations

import math

import pytest
import torch

from protofl.algorithms.registry import make_algorithm
from protofl.api import resume_experiment, run_experiment
from protofl.config import config_from_dict
from protofl.engine import private
from protofl.engine.callbacks import Callback
from protofl.engine.experiment import Experiment
from protofl.engine.runfolder import load_checkpoint, read_metrics
from protofl.errors import ProtoflError
from protofl.models.nets import Mlp
from protofl.nested import flatten
from protofl.privacy.accountant import Accountant
from protofl.privacy.contrib import SumForm, SumSettings

pytest.importorskip("dp_accounting")


def cfg(privacy: dict, algorithm: str = "fedavg", rounds: int = 3, **top):
    return config_from_dict({
        "algorithm": algorithm, "rounds": rounds, "checkpoint_every": 1, "trainer": "sequential",
        "data": {"name": "synthetic", "num_clients": 8},
        "clients": {"per_round": 4, "local_steps": 2, "batch_size": 20, "sampling": "uniform"},
        "metrics": {"dissimilarity_clients": 0, "train_loss_samples": 0},
        "privacy": {"noise_multiplier": 1.0, "adaptive_clip": True, "clip_count_std": 1.0,
                    "reproducible_noise": True, **privacy}, **top})


def step_of(norms, clip=1.0):
    """A fedavg round whose four uploads have weights updates of L2 norms ``norms``."""
    alg = make_algorithm("fedavg", {}, Mlp(2, 2, hidden=(2,)), 2)
    state = alg.init_state(alg.model)
    form = SumForm(alg, flatten(alg.broadcast(state)),
                   SumSettings(multiplier=1.0, clip=clip, clients=len(norms)))
    size = sum(v.numel() for v in state["params"].values())
    ups = []
    for n in norms:  # every entry moved by n / sqrt(size): the update's norm is n
        params = {k: v + n / math.sqrt(size) for k, v in state["params"].items()}
        ups.append({"params": params, "buffers": {}, "num_samples":
                    torch.tensor(10.0, dtype=torch.float64)})
    return private.Step(1, alg.broadcast(state), state, ups, form)


def test_the_clip_norm_follows_the_target_quantile_by_hand(monkeypatch):
    """C = 1, norms 0.5, 0.8, 0.9 and 3: three of four unclipped. With the count's noise
    left out: b = (3 x 1/2 - 1/2) / 4 + 1/2 = 0.75, C' = exp(-0.2 (0.75 - 0.5)) = exp(-0.05)
    = 0.951229...; at the target (two of four) C stays."""
    monkeypatch.setattr(private, "gaussian", lambda shape, dtype, gen: torch.zeros(shape))
    layer = private.AdaptiveClip(1.0, 0.5, 0.2, 1.0, 1.0, 4, 0, True)
    state, step = layer.update(layer.init(), step_of([0.5, 0.8, 0.9, 3.0]))
    assert step.diag["unclipped_fraction"] == pytest.approx(0.75)
    assert step.diag["clip_norm"] == 1.0 and step.form.settings.clip == 1.0
    assert state["clip"] == pytest.approx(0.951229424500714, rel=1e-12)
    assert layer.init() == {"clip": 1.0}  # the layer itself kept nothing
    state, _ = layer.update({"clip": 2.0}, step_of([0.5, 1.5, 2.5, 3.0]))
    assert state["clip"] == pytest.approx(2.0)  # two of four under 2: b = 0.5 = gamma
    # all clipped: b = 0, C' = 2 exp(0.1)
    state, _ = layer.update({"clip": 2.0}, step_of([2.5, 2.6, 2.7, 3.0]))
    assert state["clip"] == pytest.approx(2.0 * math.exp(0.1))


def test_the_count_is_noised_with_sigma_b():
    """The released fraction's noise: sigma_b / K' times the seeded draw."""
    from protofl.privacy.noise import gaussian
    from protofl.seeding import CLIP_NOISE, torch_gen

    layer = private.AdaptiveClip(1.0, 0.5, 0.2, 1.5, 1.0, 4, 7, True)
    _, step = layer.update(layer.init(), step_of([0.5, 0.8, 0.9, 3.0]))
    z = float(gaussian((1,), torch.float64, torch_gen(7, CLIP_NOISE, 1))[0])
    assert step.diag["unclipped_fraction"] == pytest.approx(0.75 + 1.5 * z / 4, rel=1e-12)


def test_the_updates_noise_keeps_the_rounds_privacy():
    """sigma_Delta = (sigma^-2 - (2 sigma_b)^-2)^(-1/2): sigma 1, sigma_b 1 gives
    1 / sqrt(3/4) = 1.1547...; the two releases combine back to sigma."""
    from protofl.privacy.noise import effective_multiplier

    assert private.update_multiplier(1.0, 1.0) == pytest.approx(2 / math.sqrt(3))
    for sigma, sb in ((1.0, 1.0), (0.7, 5.0), (2.0, 1.2)):
        combined = effective_multiplier([private.update_multiplier(sigma, sb), 2 * sb])
        assert combined == pytest.approx(sigma, rel=1e-12)


def test_an_adaptive_run_logs_its_clip_and_is_accounted_as_its_sigma(tmp_path):
    """Every round's release (updates at sigma_Delta, the count at 2 sigma_b) is accounted
    as one Gaussian of multiplier sigma: epsilon as a fixed-clip run's; the clip norm starts
    at privacy.clip and moves geometrically (at most by exp(eta) a round)."""
    summary = run_experiment(cfg({"clip": 5.0}), tmp_path / "a")
    rows = read_metrics(tmp_path / "a")
    clips = [r["clip_norm"] for r in rows]
    assert clips[0] == 5.0 and len(set(clips)) == 3
    for a, b in zip(clips, clips[1:]):
        assert math.exp(-0.2) - 1e-12 <= b / a <= math.exp(0.2) + 1e-12
    want = Accountant(1.0, 8, 4, 1e-5).epsilon(3)
    assert summary["epsilon"] == pytest.approx(want, rel=1e-9)
    snap = load_checkpoint(tmp_path / "a")
    assert snap["privacy"]["multipliers"] == pytest.approx([1.0] * 3, rel=1e-12)
    assert snap["privacy"]["clip"] == pytest.approx(
        clips[-1] * math.exp(-0.2 * (rows[-1]["unclipped_fraction"] - 0.5)))


def test_an_adaptive_run_resumes_exactly(tmp_path):
    class Kill(Callback):
        def on_round_end(self, view, record):
            if record["round"] == 2:
                raise KeyboardInterrupt

    run_experiment(cfg({"clip": 5.0}), tmp_path / "whole")
    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfg({"clip": 5.0}), tmp_path / "cut", callbacks=[Kill()])
    resume_experiment(tmp_path / "cut")
    strip = [{k: v for k, v in r.items() if k != "seconds"} for r in
             read_metrics(tmp_path / "whole")]
    assert [{k: v for k, v in r.items() if k != "seconds"} for r in
            read_metrics(tmp_path / "cut")] == strip
    a, b = load_checkpoint(tmp_path / "whole"), load_checkpoint(tmp_path / "cut")
    assert a["privacy"] == b["privacy"]
    for k, v in flatten(a["state"]).items():
        assert torch.equal(v, flatten(b["state"])[k])


def test_a_chain_composed_in_code_is_the_configs():
    """A user's chain, built layer by layer, runs the run the config's chain runs."""
    c = cfg({"clip": 5.0}, rounds=2)
    by_config = Experiment(c)
    by_config.run()
    exp = Experiment(c)
    made = private.layers(c, exp.alg, exp.data.num_clients, exp.state)
    form, p = made.form, c.privacy
    mine = private.chain(
        private.AdaptiveClip(5.0, 0.5, 0.2, 1.0, 1.0, 4, c.seed, True), private.ServerClip(),
        private.Sum(), private.GaussianNoise("server", c.seed, True), private.Estimate(),
        private.Accounting(Accountant(1.0, 8, 4, p.delta), None, True), alg=exp.alg, form=form)
    in_code = Experiment(c, aggregation=mine)
    in_code.run()
    for k, v in flatten(by_config.state).items():
        assert torch.equal(v, flatten(in_code.state)[k])
    assert in_code.aggregation.epsilon() == pytest.approx(by_config.aggregation.epsilon())


@pytest.mark.parametrize("privacy, algorithm, needle", [
    ({"noise": "client"}, "fedavg", "adaptive_clip needs .*noise: server"),
    ({"noise_multiplier": 0.0}, "fedavg", "adaptive_clip needs privacy.noise_multiplier > 0"),
    ({"clip_count_std": 0.4}, "fedavg", "clip_count_std = 0.4: .*raise it above 0.5"),
    ({}, "fedproto", "fedproto uploads no weights"),
])
def test_adaptive_clipping_it_cannot_do_is_one_line(privacy, algorithm, needle):
    with pytest.raises(ProtoflError, match=needle):
        Experiment(cfg(privacy, algorithm))
