"""Research that outgrows one machine (issue 50): ``protofl suite --executor ray`` on a Ray
cluster of two nodes on 127.0.0.1 (Ray's multi-node test cluster, one CPU each) writes the
same folders, tables and numbers as the local executor, survives a worker node killed
mid-suite (its runs are run again, no folder is left half-written), and a suite run again
picks up what finished; Flower's simulation runs on the same cluster."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'protofl[flower]')")

from ray.cluster_utils import Cluster  # noqa: E402

from protofl.engine import runfolder  # noqa: E402
from protofl.suites import plan, run_suite  # noqa: E402

SUITE = "heterogeneous"  # six small runs on digits
TINY = {"rounds": 2, "data": {"num_clients": 4},
        "clients": {"per_round": 2, "local_steps": 1, "batch_size": 16},
        "metrics": {"dissimilarity_clients": 0, "train_loss_samples": 20}}
STORE = 80 << 20  # each node's object store (Ray's minimum is 75 MiB)


@pytest.fixture(scope="module")
def cluster():
    if os.environ.get("PROTOFL_RAY_CLUSTER", "1") == "0":
        pytest.skip("PROTOFL_RAY_CLUSTER=0: the Ray cluster tests (minutes) off")
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "object_store_memory": STORE, "include_dashboard": False})
    worker = c.add_node(num_cpus=1, object_store_memory=STORE)
    c.wait_for_nodes()
    c.worker = worker
    try:
        yield c
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()


def figures(folder: Path) -> dict:
    """A run's numbers: its summary and metric lines, without times and versions."""
    drop = {"seconds", "provenance", "trainer", "rounds_by_trainer"}
    summary = {k: v for k, v in json.loads((folder / "summary.json").read_text()).items()
               if k not in drop}
    rows = [{k: v for k, v in r.items() if k != "seconds"}
            for r in runfolder.read_metrics(folder)]
    return {"summary": summary, "rows": rows}


def table(out: Path) -> list[str]:
    """``table.md`` without its wall-clock column (the one figure that is a timing)."""
    lines = (out / "table.md").read_text().replace(str(out), "OUT").splitlines()
    return [line.rsplit("|", 2)[0] if line.startswith("|") else line for line in lines]


def folders(out: Path) -> list[Path]:
    return [Path(f) for _, f in plan(SUITE, out, seeds=(0,), overrides=TINY)]


def test_a_suite_on_a_two_node_cluster_survives_a_killed_node(cluster, tmp_path, monkeypatch):
    local = tmp_path / "local"
    run_suite(SUITE, local, jobs=1, seeds=(0,), overrides=TINY)

    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    out = tmp_path / "ray"
    runs = folders(out)
    done = threading.Event()
    error: list[BaseException] = []

    def suite():
        try:
            run_suite(SUITE, out, seeds=(0,), overrides=TINY, executor="ray")
        except BaseException as e:  # noqa: BLE001 - reported by the test below
            error.append(e)
        finally:
            done.set()

    thread = threading.Thread(target=suite)
    thread.start()
    deadline = time.monotonic() + 300
    while not any((f / "summary.json").exists() for f in runs):
        assert time.monotonic() < deadline and not done.is_set(), error
        time.sleep(0.2)
    finished_at_kill = sum((f / "summary.json").exists() for f in runs)
    cluster.remove_node(cluster.worker, allow_graceful=False)  # mid-suite, no goodbye
    cluster.worker = cluster.add_node(num_cpus=1, object_store_memory=STORE)
    thread.join(600)
    assert done.is_set() and not error, error
    assert finished_at_kill < len(runs)  # the node died with runs still to do
    # every run finished once, whole, with the local executor's numbers and table
    for ray_run, local_run in zip(runs, folders(local)):
        assert runfolder.RunStore(ray_run).problems() == [], ray_run
        assert figures(ray_run) == figures(local_run), ray_run
    assert table(out) == table(local)
    assert (out / "report.html").exists()
    # a suite stopped part-way is picked up where it was: only the unfinished run runs again
    (runs[0] / "summary.json").unlink()
    before = {f: (f / "summary.json").stat().st_mtime_ns for f in runs[1:]}
    run_suite(SUITE, out, seeds=(0,), overrides=TINY, executor="ray")
    assert (runs[0] / "summary.json").exists()
    assert {f: (f / "summary.json").stat().st_mtime_ns for f in runs[1:]} == before
    assert figures(runs[0]) == figures(folders(local)[0])


def test_flower_simulation_on_the_cluster(cluster, tmp_path):
    """The Flower simulation engine joins the cluster (``init_args``' address) and gives the
    in-process engine's weights."""
    pytest.importorskip("flwr")
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation
    from simulation import client_app

    from protofl.config import config_from_dict
    from protofl.engine.experiment import Experiment
    from protofl.flower import client_app as protofl_client
    from protofl.flower.server_app import run_on_grid

    cfg = config_from_dict({
        "algorithm": "fedavg", "seed": 4, "rounds": 2, "trainer": "sequential",
        "data": {"name": "synthetic", "num_clients": 2},
        "clients": {"per_round": 2, "batch_size": 50},
        "metrics": {"dissimilarity_clients": 0, "train_loss_samples": 50}})
    got = {}
    server = ServerApp()

    @server.main()
    def _(grid: Grid, context) -> None:
        got["exp"] = run_on_grid(cfg, grid, tmp_path / "run", round_timeout=120, node_wait=60)

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address=cluster.address)
    # a node killed by the test before stays "alive" to Ray until its health checks fail;
    # until then Ray may place a ClientApp there, which then never starts
    deadline = time.monotonic() + 180
    while len(nodes := {n["NodeID"] for n in ray.nodes() if n["Alive"]}) > 2:
        assert time.monotonic() < deadline, "Ray still counts a killed node alive"
        time.sleep(1)
    ray.shutdown()
    where = tmp_path / "nodes.txt"

    def recorded(handler):
        def train(msg, context):  # the Ray node each ClientApp call runs on
            with open(where, "a") as f:
                f.write(ray.get_runtime_context().get_node_id() + "\n")
            return handler(msg, context)
        return train

    run_simulation(server, client_app(train=recorded(protofl_client.train)), num_supernodes=2,
                   backend_config={"client_resources": {"num_cpus": 1},
                                   "init_args": {"address": cluster.address}})
    assert got["exp"].round == 2 and (tmp_path / "run" / "summary.json").exists()
    used = set(where.read_text().split())
    assert len(nodes) == 2 and used and used <= nodes  # the cluster's nodes trained
    whole = Experiment(cfg)
    whole.run()
    for k, v in whole.state["params"].items():
        assert float((got["exp"].state["params"][k] - v).abs().max()) < 1e-5, k
