"""protofl on Flower: records, the simulation engine (results equal the in-process engine's),
malformed replies, and the deployment engine (SuperLink + SuperNodes on 127.0.0.1).

Ray and the SuperLink start slowly on a small machine, so each is started once per module:
one simulation runs every protofl case on the same virtual SuperNodes, and one SuperLink with
two SuperNodes serves both deployment tests (the node-killing test runs last; together about
4 minutes on a loaded 2-core machine, because a SuperNode starts a fresh ClientApp process per
message; PROTOFL_FLOWER_DEPLOYMENT=0 skips them).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr", reason="flwr is not installed (pip install 'protofl[flower]')")

from flwr.app import Context, Message, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402

from protofl.algorithms.registry import ALGORITHMS  # noqa: E402
from protofl.config import Config, config_from_dict  # noqa: E402
from protofl.engine import runfolder  # noqa: E402
from protofl.engine.experiment import Experiment  # noqa: E402
from protofl.errors import ProtoflError  # noqa: E402
from protofl.flower import client_app as protofl_client  # noqa: E402
from protofl.flower.records import tree_from_records, tree_to_records  # noqa: E402
from protofl.flower.server_app import LOG_FILE, run_on_grid  # noqa: E402
from protofl.flower.setup import check_partitions, config_from_run  # noqa: E402
from protofl.nested import flatten  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # flwr's commands installed beside this interpreter
CLIENTS = 3
POISON_ONE, POISON_ALL = 7, 8  # seeds of the runs whose clients send NaN prototypes


def tiny(algorithm: str, seed: int = 0, rounds: int = 2, clients: int = CLIENTS) -> Config:
    """A few-second federation: Synthetic, all clients active, the sequential trainer."""
    return config_from_dict({
        "algorithm": algorithm, "seed": seed, "rounds": rounds, "trainer": "sequential",
        "checkpoint_every": rounds,
        "data": {"name": "synthetic", "num_clients": clients},
        "clients": {"per_round": clients, "batch_size": 50},
        "metrics": {"dissimilarity_clients": 0, "train_loss_samples": 50}})


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


def simulation_cases() -> dict[str, Config]:
    """Every registered algorithm (fedavg, fedmargin, fedproin, the baselines), plus the
    poisoned runs."""
    cases = {name: tiny(name) for name in ALGORITHMS if name != "central"}
    cases["poison_one"] = tiny("fedmargin", seed=POISON_ONE)
    cases["poison_all"] = tiny("fedmargin", seed=POISON_ALL, rounds=1)
    return cases


@pytest.fixture(scope="module")
def simulated(tmp_path_factory) -> dict:
    """Run every case on Flower's simulation engine (3 virtual SuperNodes, one Ray start)."""
    from flwr.simulation import run_simulation

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("flower_sim")
    cases = simulation_cases()
    done: dict = {}
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        for name, cfg in cases.items():
            done[name] = run_on_grid(cfg, grid, root / name, round_timeout=600, node_wait=300)
        try:
            run_on_grid(tiny("central"), grid, root / "central", node_wait=1)
        except ProtoflError as e:
            done["refused"] = str(e)

    client = ClientApp()
    client.train()(_poisoning_train)
    client.query()(protofl_client.describe)
    client.evaluate()(protofl_client.evaluate)
    start = time.monotonic()
    run_simulation(server, client, num_supernodes=CLIENTS,
                   backend_config={"client_resources": {"num_cpus": 1},
                                   "init_args": {"num_cpus": 2}})
    done["seconds"] = time.monotonic() - start
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
        assert "central" in simulated["refused"]  # it needs the pooled data
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


# ---- deployment engine: flower-superlink + 2 flower-supernode on 127.0.0.1 ----

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(pred, timeout: float, what: str, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(every)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


class Deployment:
    """A SuperLink and two SuperNodes (each its own process group, so it can be killed
    with its ClientApp children)."""

    def __init__(self, root: Path):
        self.root, self.procs = root, {}
        self.home = root / "flwr_home"
        self.home.mkdir()
        self.port = free_port()
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "test"\n\n[superlink.test]\n'
            f'address = "127.0.0.1:{self.port}"\ninsecure = true\n')
        self.env = {**os.environ, "FLWR_HOME": str(self.home), "OMP_NUM_THREADS": "1",
                    "FLWR_DISABLE_UPDATE_CHECK": "1"}

    def start(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / f"{name}.log", "wb")
        self.procs[name] = subprocess.Popen(cmd, env=self.env, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)

    def up(self, nodes: int) -> None:
        self.start("superlink", [str(BIN / "flower-superlink"), "--insecure",
                                 "--host", "127.0.0.1",
                                 "--port", str(self.port),
                                 "--disable-runtime-dependency-installation"])
        wait_for(lambda: self._listening(self.port), 60, "the SuperLink")
        for k in range(nodes):
            self.start(f"node{k}", [
                str(BIN / "flower-supernode"), "--insecure",
                "--superlink", f"127.0.0.1:{self.port}",
                "--host", "127.0.0.1", "--port", str(free_port()),
                "--node-config", f"partition-id={k} num-partitions={nodes}"])
        wait_for(lambda: self.log("superlink").count("Activated node_id") >= nodes, 90,
                 "the SuperNodes to register")

    @staticmethod
    def _listening(port: int) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    def flwr_run(self, cfg: Config, out: Path, round_timeout: float) -> None:
        overrides = (f'out="{out}" round-timeout={round_timeout} node-wait=60.0 '
                     f'num-server-rounds={cfg.rounds} config="{self.root / "cfg.json"}" set=""')
        (self.root / "cfg.json").write_text(json.dumps(cfg.to_dict()))
        res = subprocess.run([str(BIN / "flwr"), "run", str(REPO), "test",
                              "--run-config", overrides],
                             env=self.env, cwd=self.root, capture_output=True, text=True,
                             timeout=120)
        assert res.returncode == 0 and "Successfully started run" in res.stdout, (
            res.stdout + res.stderr)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        p = self.procs[name]
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)

    def down(self) -> None:
        for name in reversed(list(self.procs)):
            self.kill(name, signal.SIGTERM)


def rows_of(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    if sys.platform == "win32":
        pytest.skip("process groups are POSIX-only")
    if os.environ.get("PROTOFL_FLOWER_DEPLOYMENT", "1") == "0":
        pytest.skip("PROTOFL_FLOWER_DEPLOYMENT=0: deployment-engine tests (about 4 min) off")
    dep = Deployment(tmp_path_factory.mktemp("flower_dep"))
    try:
        dep.up(2)
        yield dep
    finally:
        dep.down()


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


def test_flower_deployment_survives_a_killed_supernode(deployment):
    cfg = tiny("fedmargin", seed=1, clients=2)
    out = deployment.root / "run_killed"
    deployment.flwr_run(cfg, out, round_timeout=60)
    wait_for(lambda: len(rows_of(out)) >= 1, 300, "round 1")
    deployment.kill("node1")  # SIGKILL to its process group: the node and its ClientApp
    summary = wait_for(lambda: (out / "summary.json").exists() and json.loads(
        (out / "summary.json").read_text()), 240, "the run to finish", every=2)
    assert summary["rounds"] == 2
    rows = rows_of(out)
    assert 0 in rows[0]["clients"]  # (client 1 too, unless its first reply came too late)
    assert rows[1]["clients"] == [0] and rows[1]["rejected"] == [1]
    for v in runfolder.load_checkpoint(out)["state"]["params"].values():
        assert torch.isfinite(v).all()
    assert "client 1" in (out / LOG_FILE).read_text()
