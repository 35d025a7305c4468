"""Faults on a real deployment (issue 50): a SuperLink with TLS and authentication and three
SuperNodes on 127.0.0.1, each on its own port. One run loses a SuperNode mid-round (killed),
has one slower than ``round-timeout`` (stopped, then continued) and gets the killed one back
(restarted with its key once the SuperLink has marked the old node offline: two heartbeat
intervals after its last heartbeat, 60 s with flwr's default);
another loses every SuperNode (the round is sent once more, then the run stops with one line
and a failed status) and is resumed with ``resume=true`` after the SuperLink itself was
restarted. Each checks the run folder (metric rounds increasing, the
checkpoint the last complete round, the manifest), the streamed log (``flwr log``) and that
nothing waits past the timeouts. Minutes: PROTOFL_FLOWER_DEPLOYMENT=0 skips them."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time

import pytest

pytest.importorskip("flwr", reason="flwr is not installed (pip install 'protofl[flower]')")

from deployment import Deployment, wait_for  # noqa: E402
from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL, HEARTBEAT_PATIENCE  # noqa: E402

from protofl.config import config_from_dict  # noqa: E402
from protofl.engine import runfolder  # noqa: E402
from protofl.engine.experiment import Experiment  # noqa: E402

SITES = 3
TIMEOUT = 25.0  # round-timeout, seconds (a SuperNode starts a ClientApp process a message)
# the SuperLink holds a killed node online until two heartbeat intervals after its last
# heartbeat, and lets a node with the same key in only after that
OFFLINE_AFTER = HEARTBEAT_PATIENCE * HEARTBEAT_DEFAULT_INTERVAL + 5.0


def sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.monotonic()))


def tiny(seed: int, rounds: int):
    """Synthetic over three clients, every one active each round, a checkpoint every round."""
    return config_from_dict({
        "algorithm": "fedavg", "seed": seed, "rounds": rounds, "trainer": "sequential",
        "checkpoint_every": 1, "data": {"name": "synthetic", "num_clients": SITES},
        "clients": {"per_round": SITES, "batch_size": 50, "local_steps": 2},
        "metrics": {"dissimilarity_clients": 0, "train_loss_samples": 50}})


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    if sys.platform == "win32":
        pytest.skip("process groups are POSIX-only")
    if os.environ.get("PROTOFL_FLOWER_DEPLOYMENT", "1") == "0":
        pytest.skip("PROTOFL_FLOWER_DEPLOYMENT=0: deployment-engine tests (minutes) off")
    if not (shutil.which("openssl") and shutil.which("ssh-keygen")):
        pytest.skip("the development credentials need openssl and ssh-keygen")
    root = tmp_path_factory.mktemp("flower_faults")
    sites = []
    for k in range(SITES):
        (root / f"site{k}").mkdir()
        sites.append(root / f"site{k}")
    d = Deployment(root, database=True)
    try:
        d.up(sites, old=False)
        yield d
    finally:
        d.down()


def rows(out) -> list[dict]:
    return runfolder.read_metrics(out) if (out / runfolder.METRICS).exists() else []


def consistent(out, last: int) -> None:
    """Metric rounds 1..last in order, the checkpoint of round ``last``, the manifest holds."""
    assert [r["round"] for r in rows(out)] == list(range(1, last + 1))
    assert runfolder.load_checkpoint(out)["round"] == last
    assert runfolder.RunStore(out).problems() == []


def test_a_killed_a_late_and_a_returning_supernode(dep):
    cfg = tiny(seed=1, rounds=8)
    out = dep.root / "run_faults"
    run_id = dep.flwr_run(cfg, out, round_timeout=TIMEOUT)
    wait_for(lambda: len(rows(out)) >= 1, 120, "round 1")
    os.killpg(dep.procs["node2"].pid, signal.SIGSTOP)  # late: alive, replies too late
    dep.kill("node1")  # killed mid-round: SIGKILL to the node and its ClientApp
    start = time.monotonic()
    wait_for(lambda: len(rows(out)) >= 2, TIMEOUT + 60, "round 2")
    assert time.monotonic() - start < TIMEOUT + 30  # no wait past the round's timeout
    os.killpg(dep.procs["node2"].pid, signal.SIGCONT)
    sleep_until(start + OFFLINE_AFTER)
    dep.supernode("node1_back", "supernode_2", dep.node_configs[1])  # back, same key
    summary = wait_for(lambda: (out / "summary.json").exists() and json.loads(
        (out / "summary.json").read_text()), 7 * TIMEOUT + 120, "the run to finish", every=2)
    assert summary["rounds"] == 8
    wait_for(lambda: dep.run_status(run_id).startswith("finished"), 60, "the ServerApp to end",
             every=2)
    got = rows(out)
    assert got[1]["clients"] == [0] and got[1]["rejected"] == [1, 2]  # round 2
    assert got[-1]["clients"] == [0, 1, 2], got[-1]  # both are back by round 8
    consistent(out, 8)
    assert dep.run_status(run_id) == "finished:completed"
    streamed = dep.run_log(run_id)
    assert "protofl: round 2: client 1 (node" in streamed and "left out" in streamed
    assert "unexpected node" not in (out / "flower.log").read_text()


def test_every_supernode_gone_stops_the_run_and_resume_continues_it(dep):
    cfg = tiny(seed=2, rounds=3)
    out = dep.root / "run_gone"
    run_id = dep.flwr_run(cfg, out, round_timeout=TIMEOUT)
    wait_for(lambda: len(rows(out)) >= 1, 120, "round 1")
    start = time.monotonic()
    for name in [n for n in dep.procs if n.startswith("node")]:
        dep.kill(name)
    wait_for(lambda: dep.run_status(run_id).startswith("finished"), 3 * TIMEOUT + 60,
             "the run to stop", every=2)
    assert time.monotonic() - start < 2 * TIMEOUT + 60  # two tries of round 2, no more
    assert dep.run_status(run_id) == "finished:failed"
    streamed = dep.run_log(run_id)
    assert "fewer than min-replies = 1; the round is sent once more" in streamed
    assert "protofl: error: flower: round 2: 0 of 3 clients replied, twice" in streamed
    consistent(out, 1)
    assert not (out / "summary.json").exists()
    # the coordinator's machine restarts: the SuperLink (its database keeps the registered
    # keys), the SuperNodes, then the same run with resume=true
    dep.kill("superlink", signal.SIGTERM)
    dep.superlink()
    sleep_until(start + OFFLINE_AFTER)  # the old nodes' records are offline
    for k in range(SITES):
        dep.supernode(f"node{k}_again", f"supernode_{k + 1}", dep.node_configs[k])
    # every node must reply here: a generous timeout, since a fresh SuperNode's first
    # ClientApp process can take longer than TIMEOUT on a loaded machine
    # (the SuperLink lets a node in once its old record is offline: the run waits for them)
    run_id = dep.flwr_run(cfg, out, round_timeout=4 * TIMEOUT, extra="resume=true",
                          node_wait=240.0)
    summary = wait_for(lambda: (out / "summary.json").exists() and json.loads(
        (out / "summary.json").read_text()), 240 + 2 * 4 * TIMEOUT + 120,
        "the resumed run to finish", every=2)
    wait_for(lambda: dep.run_status(run_id).startswith("finished"), 60, "the ServerApp to end",
             every=2)
    assert summary["rounds"] == 3 and dep.run_status(run_id) == "finished:completed"
    consistent(out, 3)
    assert [r["clients"] for r in rows(out)] == [[0, 1, 2]] * 3
    whole = Experiment(cfg)  # fedavg keeps no client state: it ends where one run ends
    whole.run()
    state = runfolder.load_checkpoint(out)["state"]
    for k, v in whole.state["params"].items():
        assert float((state["params"][k] - v).abs().max()) < 1e-5, k
