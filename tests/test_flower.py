"""protofl on Flower: records, the simulation engine (results equal the in-process engine's),
malformed replies, site mode, resuming a killed run, and the deployment engine (SuperLink +
SuperNodes on 127.0.0.1).

Ray and the SuperLink start slowly on a small machine, so each is started once per module:
one simulation runs every protofl case on the same virtual SuperNodes (and resumes a run
killed, before it, in a subprocess: one more Ray start), and one SuperLink with two
SuperNodes serves every deployment test (the node-killing test runs last; a SuperNode starts a
fresh ClientApp process per message, so they take minutes; PROTOFL_FLOWER_DEPLOYMENT=0 skips
them).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("flwr", reason="flwr is not installed (pip install 'protofl[flower]')")

from deployment import OLD_VERSION, REPO, Deployment, wait_for  # noqa: E402
from flwr.app import Context, Message, RecordDict  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402
from simulation import client_app, simulate  # noqa: E402
from sitefiles import write_site  # noqa: E402

from protofl.algorithms.registry import ALGORITHMS  # noqa: E402
from protofl.api import run_experiment  # noqa: E402
from protofl.config import Config, config_from_dict, load_raw  # noqa: E402
from protofl.data.federated import FederatedData  # noqa: E402
from protofl.data.site import server_federation, site_data  # noqa: E402
from protofl.engine import runfolder  # noqa: E402
from protofl.engine.experiment import Experiment  # noqa: E402
from protofl.errors import ProtoflError  # noqa: E402
from protofl.flower import client_app as protofl_client  # noqa: E402
from protofl.flower.node import AUDIT_ENV, protofl_version  # noqa: E402
from protofl.flower.records import tree_from_records, tree_to_records  # noqa: E402
from protofl.flower.server_app import (  # noqa: E402
    LOG_FILE,
    restore,
    resume_flag,
    run_on_grid,
    short,
)
from protofl.flower.setup import check_partitions, config_from_run  # noqa: E402
from protofl.metrics.classification import report  # noqa: E402
from protofl.metrics.federated import client_predictions, scores  # noqa: E402
from protofl.nested import flatten  # noqa: E402

CLIENTS = 3
POISON_ONE, POISON_ALL = 7, 8  # seeds of the runs whose clients send NaN prototypes
SITE_SEEDS = {"site_fedmargin": 20, "site_fedproto": 21, "site_refused": 22}
SITE_CLASSES = ["a", "b", "c"]
SITE_COUNTS = [{"a": 12, "b": 6}, {"b": 10, "c": 8}, {"a": 5, "c": 9, "b": 3}]
SITES_ENV = "PROTOFL_TEST_SITES"  # the simulated nodes' site files: <root>/seed<S>/site<K>
RESUME_SEED = 30


def tiny(algorithm: str, seed: int = 0, rounds: int = 2, clients: int = CLIENTS) -> Config:
    """A few-second federation: Synthetic, all clients active, the sequential trainer."""
    return config_from_dict({
        "algorithm": algorithm, "seed": seed, "rounds": rounds, "trainer": "sequential",
        "checkpoint_every": rounds,
        "data": {"name": "synthetic", "num_clients": clients},
        "clients": {"per_round": clients, "batch_size": 50},
        "metrics": {"dissimilarity_clients": 0, "train_loss_samples": 50}})


def site_config(algorithm: str, seed: int, **data) -> Config:
    """A site federation of CLIENTS sites (8x8 grey image folders, classes a, b, c)."""
    return config_from_dict({
        "algorithm": algorithm, "seed": seed, "rounds": 2, "trainer": "sequential",
        "checkpoint_every": 2,
        "data": {"name": "site", "num_clients": CLIENTS, "classes": SITE_CLASSES,
                 "input_shape": [1, 8, 8], **data},
        "model": {"name": "mlp"}, "clients": {"per_round": CLIENTS, "batch_size": 8}})


def write_sites(root: Path) -> None:
    """The files of every site case: <root>/seed<S>/site<K>; seed 22's site 2 holds a class
    outside the federation's."""
    for seed in SITE_SEEDS.values():
        for k, counts in enumerate(SITE_COUNTS):
            if seed == SITE_SEEDS["site_refused"] and k == 2:
                counts = {"a": 4, "zebra": 3}
            write_site(root / f"seed{seed}" / f"site{k}", counts, SITE_CLASSES, seed=k)
    write_site(root / "central", {"a": 4, "b": 4, "c": 4}, SITE_CLASSES, seed=50)


def engine_state(cfg: Config) -> dict:
    exp = Experiment(cfg)
    exp.run()
    return exp.state


def assert_same_weights(a: dict, b: dict) -> None:
    assert a["params"].keys() == b["params"].keys()
    for k in a["params"]:
        torch.testing.assert_close(a["params"][k], b["params"][k], rtol=1e-5, atol=1e-6)
    if "protos" in a:
        torch.testing.assert_close(a["protos"], b["protos"], rtol=1e-5, atol=1e-5)


# ---- records and run config (no engine) ----

def test_flower_records_roundtrip_keeps_structure_dtype_and_shape():
    tree = {"params": {"body.0.weight": torch.randn(2, 3),
                       "b": torch.zeros(2, dtype=torch.float64)},
            "buffers": {}, "num_samples": torch.tensor(5.0, dtype=torch.float64),
            "counts": torch.tensor([1, 0, 4])}
    back = tree_from_records(tree_to_records(tree, "up", RecordDict()), "up")
    assert back.keys() == tree.keys() and back["buffers"] == {}
    for k in ("num_samples", "counts"):
        assert back[k].dtype == tree[k].dtype and back[k].shape == tree[k].shape
        assert torch.equal(back[k], tree[k])
    for k, v in tree["params"].items():
        assert back["params"][k].dtype == v.dtype and torch.equal(back["params"][k], v)


def test_flower_records_malformed_raise_protofl_error():
    rd = tree_to_records({"a": torch.ones(2)}, "up", RecordDict())
    with pytest.raises(ProtoflError, match="missing"):
        tree_from_records(rd, "other")
    rd["up.tree"]["json"] = json.dumps({"a": [3, [2]]})  # no array 3
    with pytest.raises(ProtoflError, match="no array"):
        tree_from_records(rd, "up")
    rd["up.tree"]["json"] = json.dumps({"a": [0, [5]]})  # wrong shape
    with pytest.raises(ProtoflError, match="unreadable array"):
        tree_from_records(rd, "up")


def test_flower_run_config_builds_protofl_config():
    cfg = config_from_run({"config": "", "set": "algorithm=fedavg; data.num_clients=4; "
                           "clients.lr=0.5", "num-server-rounds": 3})
    assert (cfg.algorithm, cfg.data.num_clients, cfg.clients.lr, cfg.rounds) == (
        "fedavg", 4, 0.5, 3)
    with pytest.raises(ProtoflError, match="clients.nope"):
        config_from_run({"set": "clients.nope=1"})


def test_flower_run_config_defaults_keep_the_named_config(tmp_path):
    """pyproject's run-config defaults plus ``config=`` give exactly that config (a default
    ``set`` or round count would silently replace what the user's file says)."""
    tomllib = pytest.importorskip("tomllib")
    defaults = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["flwr"]["app"][
        "config"]
    path = tmp_path / "sites.yaml"
    path.write_text("algorithm: fedavg\nrounds: 7\ndata: {name: digits, num_clients: 3}\n"
                    "clients: {per_round: 3}\n")
    cfg = config_from_run({**defaults, "config": str(path)})
    assert cfg == config_from_dict(load_raw(str(path)))
    assert (cfg.rounds, cfg.data.num_clients) == (7, 3)


def test_flower_site_node_that_cannot_join_logs_one_line(tmp_path, caplog):
    """A SuperNode whose files hold another class logs why (the error reply goes to the
    server); one that fits builds its own Experiment with the agreed classes."""
    write_site(tmp_path / "good", {"a": 5, "c": 5}, SITE_CLASSES)
    write_site(tmp_path / "odd", {"a": 5, "zebra": 2}, SITE_CLASSES)
    cfg_json = json.dumps(Experiment(site_config("fedavg", 0)).cfg.to_dict())
    nc = {"partition-id": 1, "num-partitions": CLIENTS, "data-root": str(tmp_path / "good")}
    exp = protofl_client.node_experiment(cfg_json, Context(1, 2, nc, RecordDict(), {})).fed
    assert exp.data.train_sizes.tolist() == [0, 8, 0] and exp.data.class_names == SITE_CLASSES
    nc = {**nc, "data-root": str(tmp_path / "odd")}
    with caplog.at_level(logging.ERROR, logger="flwr"):
        with pytest.raises(ProtoflError, match="zebra"):
            protofl_client.node_experiment(cfg_json, Context(1, 2, nc, RecordDict(), {}))
    assert "this node cannot join the run: site 1 (imagefolder at" in caplog.text


def test_flower_partition_count_must_match_clients():
    exp = Experiment(tiny("fedavg", clients=2))
    check_partitions(2, exp.data)
    with pytest.raises(ProtoflError, match="num-partitions = 3 but .* has 2 clients"):
        check_partitions(3, exp.data)


# ---- simulation engine: one Ray start runs every case ----

def _poisoning_train(msg: Message, context: Context) -> Message:
    """protofl's ClientApp, except that in the POISON runs it sends NaN prototypes."""
    reply = protofl_client.train(msg, context)
    seed = json.loads(str(msg.content.config_records["job"]["config"]))["seed"]
    pid = int(context.node_config["partition-id"])
    if seed == POISON_ALL or (seed == POISON_ONE and pid == 0):
        up = tree_from_records(reply.content, "upload")
        up["protos"] = torch.full_like(up["protos"], float("nan"))
        content = tree_to_records(up, "upload", RecordDict())
        content["metrics"] = reply.content.metric_records["metrics"]
        reply = Message(content, reply_to=msg)
    return reply


def _message_config(msg: Message) -> dict:
    records = msg.content.config_records
    rec = records["job"] if "job" in records else records["query"]
    return json.loads(str(rec["config"])) if "config" in rec else {}


def _as_site(handler):
    """protofl's handler on a simulated node; in the site cases the node's data-root is its
    own folder of site files (a deployment sets it with --node-config)."""

    def run(msg: Message, context: Context) -> Message:
        cfg = _message_config(msg)
        if cfg.get("data", {}).get("name") == "site":
            pid = context.node_config["partition-id"]
            context.node_config["data-root"] = str(
                Path(os.environ[SITES_ENV]) / f"seed{cfg['seed']}" / f"site{pid}")
        return handler(msg, context)

    return run


def simulation_cases(root: Path) -> dict[str, Config]:
    """Every registered algorithm (fedavg, fedmargin, fedproin, the baselines), the poisoned
    runs, the site-mode runs, and the uninterrupted twin of the killed run."""
    cases = {name: tiny(name) for name in ALGORITHMS if name != "central"}
    cases["poison_one"] = tiny("fedmargin", seed=POISON_ONE)
    cases["poison_all"] = tiny("fedmargin", seed=POISON_ALL, rounds=1)
    cases["site_fedmargin"] = site_config("fedmargin", SITE_SEEDS["site_fedmargin"],
                                          root=str(root / "sites" / "central"))
    cases["site_fedproto"] = site_config("fedproto", SITE_SEEDS["site_fedproto"])
    cases["site_refused"] = site_config("fedavg", SITE_SEEDS["site_refused"])
    cases["resume"] = config_from_dict({**tiny("fedmargin", seed=RESUME_SEED, rounds=3)
                                        .to_dict(), "checkpoint_every": 1})
    return cases


def kill_after_round_one(cfg: Config, out: Path) -> dict:
    """Run ``cfg`` on Flower in a subprocess (own Ray, own session), SIGKILL it once round 1
    is checkpointed; what the run folder then holds."""
    (out.parent / "killed.json").write_text(json.dumps(cfg.to_dict()))
    marker = out.parent / "killed.marker"
    log = open(out.parent / "killed.log", "wb")
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("flower_kill_run.py")),
                             str(out.parent / "killed.json"), str(out), str(marker)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: marker.exists() or proc.poll() is not None, 600, "round 1", every=1)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
        log.close()
    assert marker.exists(), (out.parent / "killed.log").read_text()[-3000:]
    return {"rows": [r["round"] for r in rows_of(out)],
            "checkpoint": runfolder.load_checkpoint(out)["round"],
            "summary": (out / runfolder.SUMMARY).exists()}


@pytest.fixture(scope="module")
def simulated(tmp_path_factory) -> dict:
    """Run every case on Flower's simulation engine (3 virtual SuperNodes, one Ray start)."""

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("flower_sim")
    write_sites(root / "sites")
    cases = simulation_cases(root)
    done: dict = {"killed": kill_after_round_one(cases["resume"], root / "resumed")}
    # a run stopped before its first checkpoint: config, one metrics line and the log only
    stopped = root / "restarted"
    stopped.mkdir()
    (stopped / runfolder.CONFIG).write_text(json.dumps(cases["resume"].to_dict()))
    (stopped / runfolder.METRICS).write_text('{"round": 1}\n')
    (stopped / LOG_FILE).write_text("started\n")
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        for name, cfg in cases.items():
            wait = 10 if name == "site_refused" else 300  # its site 2 never joins
            done[name] = run_on_grid(cfg, grid, root / name, round_timeout=600, node_wait=wait)
        done["resumed"] = run_on_grid(cases["resume"], grid, root / "resumed", resume=True)
        run_on_grid(cases["resume"], grid, stopped, resume=True)  # nothing to resume: afresh
        for name, kw in (("central", {"cfg": tiny("central"), "out": root / "central"}),
                         ("again", {"cfg": cases["resume"], "out": root / "resume"})):
            try:
                run_on_grid(kw["cfg"], grid, kw["out"], node_wait=1)
            except ProtoflError as e:
                done[f"refused_{name}"] = str(e)

    client = client_app(_poisoning_train, _as_site)
    # the virtual nodes' site files and audit logs
    done["seconds"] = simulate(server, client, CLIENTS, {
        SITES_ENV: str(root / "sites"), AUDIT_ENV: str(root / "audit")})
    done["root"], done["cases"] = root, cases
    return done


@pytest.mark.parametrize("algorithm", sorted({"fedavg", "fedmargin", "fedproin", *ALGORITHMS}))
def test_flower_simulation_matches_engine(simulated, algorithm):
    """Same seed, same data, all clients active: the Flower run ends in the engine's state
    (global weights, prototypes, ...) and reports the engine's figures. Personalised methods
    are evaluated on the nodes, with the models that never left them."""
    if algorithm not in ALGORITHMS:
        pytest.skip(f"{algorithm} is not registered in algorithms/registry.py yet")
    if algorithm == "central":
        assert "central" in simulated["refused_central"]  # it needs the pooled data
        return
    assert algorithm in simulated, "the simulation did not run this case"
    exp = simulated[algorithm]
    assert exp.round == 2 and exp.trainer.name == "flower"
    ref = Experiment(simulated["cases"][algorithm])
    ref_summary = ref.run()
    a, b = flatten(exp.state), flatten(ref.state)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5)
    folder = simulated["root"] / algorithm
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    assert all(r["clients"] == [0, 1, 2] and r["rejected"] == [] for r in rows)
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["rounds"] == 2 and summary["trainer"] == "flower"
    for key in ("accuracy", "local_accuracy", "f1_macro"):
        assert summary[key] == pytest.approx(ref_summary[key], abs=1e-6), key


def test_flower_simulation_nan_reply_is_dropped_and_logged(simulated):
    exp = simulated["poison_one"]
    assert exp.round == 2
    for v in exp.state["params"].values():
        assert torch.isfinite(v).all()
    assert torch.isfinite(exp.state["protos"]).all()
    folder = simulated["root"] / "poison_one"
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    assert all(r["clients"] == [1, 2] and r["rejected"] == [0] for r in rows)
    text = (folder / LOG_FILE).read_text()
    assert "client 0" in text and "NaN" in text and "'protos'" in text


def test_flower_simulation_round_without_valid_reply_keeps_state(simulated):
    exp = simulated["poison_all"]
    cfg = simulated["cases"]["poison_all"]
    start = Experiment(cfg).state  # the initial global state of the same seed
    assert exp.round == 1
    assert_same_weights(exp.state, start)
    row = json.loads((simulated["root"] / "poison_all" / "metrics.jsonl").read_text())
    assert row["clients"] == [] and row["rejected"] == [0, 1, 2]


def site_reference(exp: Experiment, root: Path) -> Experiment:
    """The in-process engine over the same sites: every site's rows as its client, the
    server's test set as the global one, trained sequentially with the Flower run's config."""
    cfg = exp.cfg
    seed_root = root / "sites" / f"seed{cfg.seed}"
    parts = [site_data(cfg.data, "imagefolder", str(seed_root / f"site{k}"), k)
             for k in range(CLIENTS)]
    tr = [p.client_train(k) for k, p in enumerate(parts)]
    te = [p.client_test(k) for k, p in enumerate(parts)]
    server = server_federation(cfg.data)
    data = FederatedData("site", 3, torch.cat([x for x, _ in tr]), torch.cat([y for _, y in tr]),
                         np.cumsum([0] + [len(y) for _, y in tr]), torch.cat([x for x, _ in te]),
                         torch.cat([y for _, y in te]), np.cumsum([0] + [len(y) for _, y in te]),
                         server.x_test, server.y_test, SITE_CLASSES, scale=parts[0].scale)
    ref = Experiment(cfg, data=data)
    ref.run()
    return ref


@pytest.mark.parametrize("case", ["site_fedmargin", "site_fedproto"])
def test_flower_site_mode_matches_the_engine_over_the_same_sites(simulated, case):
    """Site mode: the nodes train on their own files, the server holds none and ends in the
    state of the engine given every site's rows; evaluation is federated (the sites' pooled
    counts, weighted by size), and central too where the server has a test set."""
    exp = simulated[case]
    assert exp.round == 2 and len(exp.data.y_train) == 0
    assert exp.data.train_sizes.tolist() == [15, 14, 13]  # as the sites reported them
    ref = site_reference(exp, simulated["root"])
    a, b = flatten(exp.state), flatten(ref.state)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5)
    rows = rows_of(simulated["root"] / case)
    assert [r["clients"] for r in rows] == [[0, 1, 2], [0, 1, 2]]
    last = rows[-1]
    assert "train_loss" not in last and "dissimilarity" not in last  # no training data here
    preds = client_predictions(ref.alg, ref.alg.model, ref.state, ref.data, ref.client_states)
    pooled = report(torch.cat([y for y, _ in preds.values()]).numpy(),
                    torch.cat([p.argmax(1) for _, p in preds.values()]).numpy(), 3)
    assert last["federated_accuracy"] == pytest.approx(pooled["accuracy"], abs=1e-9)
    assert last["local_accuracy"] == pytest.approx(ref.last["local_accuracy"], abs=1e-6)
    assert last["clients_evaluated"] == 3  # the sites scored (the server holds no site)
    if case == "site_fedmargin":  # central: the server's own 12 test images
        assert sum(map(sum, last["confusion"])) == 12
        assert last["accuracy"] == pytest.approx(ref.last["accuracy"], abs=1e-9)
        assert last["amm"] == pytest.approx(ref.last["amm"], rel=1e-6)
        w = ref.alg.global_weights(ref.state)
        s = scores(ref.alg, ref.alg.model, w["params"], w["buffers"], ref.state,
                   ref.data.inputs(ref.data.x_local_test), 64)
        loss = float(torch.nn.functional.cross_entropy(s, ref.data.y_local_test))
        assert last["federated_loss"] == pytest.approx(loss, rel=1e-5)
    else:  # personalised: the sites' own models, pooled
        assert sum(map(sum, last["confusion"])) == 3 + 4 + 4  # every site's held-out images
        assert last["accuracy"] == last["federated_accuracy"]


def test_flower_site_with_other_classes_is_left_out(simulated):
    exp = simulated["site_refused"]
    folder = simulated["root"] / "site_refused"
    rows = rows_of(folder)
    assert [r["clients"] for r in rows] == [[0, 1], [0, 1]]
    assert all(r["rejected"] == [2] for r in rows)
    text = (folder / LOG_FILE).read_text()
    assert "cannot join" in text and "'zebra' (3 samples), not one of" in text
    assert exp.data.train_sizes.tolist() == [15, 14, 14]  # site 2: the mean, rounded


def test_flower_resumed_run_ends_as_an_uninterrupted_one(simulated):
    """A Flower run killed (SIGKILL) after round 1 and started again with resume=true ends
    in the state, and with the metrics, of the run that was never interrupted."""
    killed = simulated["killed"]
    assert killed == {"rows": [1], "checkpoint": 1, "summary": False}
    resumed, ref = simulated["resumed"], simulated["resume"]
    assert resumed.round == ref.round == 3
    a, b = flatten(resumed.state), flatten(ref.state)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    want = rows_of(simulated["root"] / "resume")
    assert [r["round"] for r in want] == [1, 2, 3]
    # resumed from round 1, and restarted afresh (resume=true, stopped before a checkpoint)
    for folder in ("resumed", "restarted"):
        got = rows_of(simulated["root"] / folder)
        assert [r["round"] for r in got] == [1, 2, 3], folder
        for r, w in zip(got, want):
            assert {k: v for k, v in r.items() if k != "seconds"} == {
                k: v for k, v in w.items() if k != "seconds"}, folder
    assert "resuming" in (simulated["root"] / "resumed" / LOG_FILE).read_text()
    assert "add resume=true" in simulated["refused_again"]


def test_flower_resume_refuses_another_config(tmp_path):
    cfg = tiny("fedavg", rounds=2)
    run_experiment(config_from_dict({**cfg.to_dict(), "checkpoint_every": 1, "rounds": 1}),
                   tmp_path / "run")
    other = Experiment(config_from_dict({**cfg.to_dict(), "checkpoint_every": 1,
                                         "clients": {**cfg.to_dict()["clients"], "lr": 0.5}}))
    with pytest.raises(ProtoflError, match="clients.lr = 0.5, the run was started with 0.01"):
        restore(other, tmp_path / "run")
    same = Experiment(config_from_dict({**cfg.to_dict(), "checkpoint_every": 1}))
    restore(same, tmp_path / "run")  # more rounds are fine
    assert same.round == 1
    assert json.loads((tmp_path / "run" / runfolder.CONFIG).read_text())["rounds"] == 2


def test_flower_resume_flag_and_error_reasons():
    assert resume_flag(True) and resume_flag("true") and not resume_flag("") and not resume_flag(
        "false")
    with pytest.raises(ProtoflError, match="resume = 'maybe'"):
        resume_flag("maybe")
    wrapped = "<class 'protofl.errors.ProtoflError'>:<'site 1: class 'x' is odd'>"
    assert short(wrapped) == "ProtoflError: site 1: class 'x' is odd"
    assert short("Traceback\n  line\nValueError: bad\n") == "ValueError: bad"


# ---- deployment engine: flower-superlink + 2 flower-supernode on 127.0.0.1 ----

def rows_of(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    if sys.platform == "win32":
        pytest.skip("process groups are POSIX-only")
    if os.environ.get("PROTOFL_FLOWER_DEPLOYMENT", "1") == "0":
        pytest.skip("PROTOFL_FLOWER_DEPLOYMENT=0: deployment-engine tests (minutes) off")
    if not (shutil.which("openssl") and shutil.which("ssh-keygen")):
        pytest.skip("the development credentials need openssl and ssh-keygen")
    root = tmp_path_factory.mktemp("flower_dep")
    sites = [write_site(root / f"site{k}", counts, SITE_CLASSES, seed=k)
             for k, counts in enumerate(SITE_COUNTS[:2])]
    dep = Deployment(root)
    start = time.monotonic()
    try:
        dep.up(sites)
        dep.started = time.monotonic() - start
        yield dep
    finally:
        dep.down()


def test_flower_deployment_refuses_an_unknown_supernode(deployment):
    """A SuperNode whose key was never registered cannot join: it stops with an error (Flower's
    exit code 305 in its log) and the SuperLink logs the unknown key."""
    deployment.supernode("intruder", "supernode_3", "partition-id=0 num-partitions=2")
    rc = wait_for(lambda: deployment.procs["intruder"].poll(), 120, "the intruder to stop")
    assert rc == 1  # Flower prints its own exit code and ends the process with 1
    assert "Exit Code: 305" in deployment.log("intruder")
    assert "Failed to activate SuperNode" in deployment.log("intruder")
    assert "No SuperNode found with the given public key" in deployment.log("superlink")
    assert deployment.log("superlink").count("Activated node_id") == 3  # 2 sites + the old


def test_flower_deployment_site_mode_with_tls_and_authentication(deployment):
    """Two hospitals on 127.0.0.1, TLS and node authentication: each SuperNode trains on its
    own image folder (data-root in its node config), the server has no training data."""
    cfg = config_from_dict({
        "algorithm": "fedmargin", "seed": 3, "rounds": 2, "eval_every": 2,
        "trainer": "sequential", "checkpoint_every": 2,
        "data": {"name": "site", "num_clients": 2, "classes": SITE_CLASSES,
                 "input_shape": [1, 8, 8]},
        "model": {"name": "mlp"}, "clients": {"per_round": 2, "batch_size": 8}})
    out = deployment.root / "site_run"
    start = time.monotonic()
    deployment.flwr_run(cfg, out, round_timeout=240)
    summary = wait_for(lambda: (out / "summary.json").exists() and json.loads(
        (out / "summary.json").read_text()), 600, "the run to finish", every=2)
    deployment.site_seconds = time.monotonic() - start
    assert summary["rounds"] == 2 and summary["dataset"] == "site"
    rows = rows_of(out)
    assert [r["round"] for r in rows] == [2] and rows[0]["clients"] == [0, 1]
    assert sum(map(sum, rows[0]["confusion"])) == 3 + 4  # the sites' held-out images
    assert 0 <= rows[0]["federated_accuracy"] <= 1 and set(rows[0]["client_accuracy"]) == {
        "0", "1"}
    log = (out / LOG_FILE).read_text()
    assert log.splitlines()[0].endswith("federation: TLS on, SuperNode authentication on (from "
                                        "the SuperLink's command line)")
    assert "site 0 (node" in log and "15 training and 3 held-out samples" in log
    assert (f"left out (it cannot join): ProtoflError: flower: version mismatch: the server "
            f"runs protofl {protofl_version()}, this node {OLD_VERSION}") in log
    for k in range(2):  # each site's audit log: what it sent, message by message
        (path,) = (deployment.root / f"audit{k}").glob(f"run*-partition{k}.jsonl")
        sent = [json.loads(x) for x in path.read_text().splitlines()]
        assert [x["message"] for x in sent] == ["query", "train", "train", "evaluate"]
        assert "num-examples" in sent[0]["entries"] and sent[1]["secure"] is False
    assert not (deployment.root / "audit_old").exists()  # it sent nothing but its refusal


def test_flower_deployment_fedmargin_two_rounds(deployment):
    cfg = tiny("fedmargin", clients=2)
    out = deployment.root / "run"
    deployment.flwr_run(cfg, out, round_timeout=240)
    summary = wait_for(lambda: (out / "summary.json").exists() and json.loads(
        (out / "summary.json").read_text()), 420, "the run to finish", every=2)
    assert summary["rounds"] == 2 and summary["trainer"] == "flower"
    assert [r["clients"] for r in rows_of(out)] == [[0, 1], [0, 1]]
    state = runfolder.load_checkpoint(out)["state"]
    assert_same_weights(state, engine_state(cfg))


def test_flower_deployment_rotates_a_site_key(deployment):
    """Site 0 rotates its key as docs/flower.md says: the coordinator registers the new public
    key, the site restarts its SuperNode with the new private key, the coordinator unregisters
    the old node; then the old key is refused and the new one admitted. (Last in the module:
    site 0 runs on its new key from here on.)"""
    dep = deployment
    activated = dep.log("superlink").count("Activated node_id")
    out = dep.flwr("supernode", "register", str(dep.certs / "supernode_5.pub"), "test")
    assert "registered successfully" in out, out
    dep.kill("node0", signal.SIGTERM)
    dep.supernode("node0_new", "supernode_5", dep.node_configs[0])
    wait_for(lambda: dep.log("superlink").count("Activated node_id") > activated, 120,
             "the new key to be admitted")
    out = dep.flwr("supernode", "unregister", dep.node_ids[0], "test")
    assert f"SuperNode {dep.node_ids[0]} unregistered successfully" in out, out
    listed = json.loads(dep.flwr("supernode", "list", "test", "--format", "json"))
    status = {n["node-id"]: n["status"] for n in listed["nodes"]}
    assert status.get(dep.node_ids[0], "unregistered") == "unregistered"
    dep.supernode("node0_old", "supernode_1", dep.node_configs[0])
    rc = wait_for(lambda: dep.procs["node0_old"].poll(), 120, "the old key to be refused")
    assert rc == 1 and "Failed to activate SuperNode" in dep.log("node0_old")
    assert dep.procs["node0_new"].poll() is None  # the new key's node stays connected
