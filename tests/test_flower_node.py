"""What a SuperNode decides for itself, run fast: the ServerApp's round loop over a grid whose
nodes are protofl's ClientApp handlers called in this process (no SuperLink, no Ray). A node
imports no callback the server's config names; under privacy it sends no sample count in
clear; it writes one audit line per message; a node of another protofl minor version is
refused with one line the server logs; a node's own device, threads and eval batch win."""

from __future__ import annotations

import copy
import json
import logging
import sys
import uuid
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr", reason="flwr is not installed (pip install 'protofl[flower]')")

from flwr.app import Context, Error, Message, RecordDict  # noqa: E402

try:  # flwr >= 1.4x: a Message made outside a SuperNode needs the task's identity
    from flwr.supercore.task_identity import TaskIdentity
except ImportError:
    TaskIdentity = None

from protofl.config import config_from_dict  # noqa: E402
from protofl.errors import ProtoflError  # noqa: E402
from protofl.flower import client_app, node  # noqa: E402
from protofl.flower.server_app import run_on_grid  # noqa: E402

CLIENTS = 3
EVIL = "protofl_test_evil_callbacks"  # a module whose import leaves a marker file


class LocalGrid:
    """A Flower ``Grid`` whose nodes are protofl's ClientApp handlers in this process; an
    exception becomes an error reply, as a SuperNode sends it. ``versions`` gives a node
    another protofl version."""

    def __init__(self, contexts: dict[int, Context], versions: dict[int, str] | None = None):
        self.contexts, self.versions = contexts, versions or {}
        self.replies: dict[str, Message] = {}
        self.handlers = {"query": client_app.describe, "train": client_app.train,
                         "evaluate": client_app.evaluate}

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def push_messages(self, msgs: list[Message]) -> list[str]:
        ids = []
        for m in msgs:
            mid = uuid.uuid4().hex
            m.metadata.__dict__["_message_id"] = mid
            m = copy.deepcopy(m)  # as sent over the wire: the handler's own copy
            dst = m.metadata.dst_node_id
            real = node.protofl_version
            if dst in self.versions:
                node.protofl_version = lambda v=self.versions[dst]: v
            try:
                reply = self.handlers[m.metadata.message_type](m, self.contexts[dst])
            except Exception as e:  # what a SuperNode does with a ClientApp's exception
                reply = Message(Error(code=0, reason=f"{type(e).__name__}: {e}"), reply_to=m)
            finally:
                node.protofl_version = real
            self.replies[mid] = reply
            ids.append(mid)
        return ids

    def pull_messages(self, ids: list[str]) -> list[Message]:
        return [self.replies.pop(i) for i in ids if i in self.replies]

    def send_and_receive(self, msgs, timeout: float | None = None) -> list[Message]:
        return self.pull_messages(self.push_messages(list(msgs)))


@pytest.fixture
def grid(monkeypatch, tmp_path):
    """Three nodes (ids 11, 12, 13 hold partitions 0-2), each with its own audit folder."""
    for key, value in (("_run_id", 5), ("_node_id", 1), ("_task_id", 1)):
        if TaskIdentity is not None:
            monkeypatch.setattr(TaskIdentity, key, value)

    def make(versions: dict[int, str] | None = None, **node_config) -> LocalGrid:
        contexts = {11 + k: Context(5, 11 + k, {"partition-id": k, "num-partitions": CLIENTS,
                                                "audit-dir": str(tmp_path / f"audit{k}"),
                                                **node_config}, RecordDict(), {})
                    for k in range(CLIENTS)}
        return LocalGrid(contexts, versions)

    return make


def tiny(algorithm: str = "fedavg", **extra) -> dict:
    return {"algorithm": algorithm, "seed": 0, "rounds": 2, "trainer": "sequential",
            "checkpoint_every": 2, "data": {"name": "synthetic", "num_clients": CLIENTS},
            "clients": {"per_round": CLIENTS, "batch_size": 50, "local_steps": 2},
            "metrics": {"dissimilarity_clients": 0, "train_loss_samples": 50}, **extra}


def audit_lines(tmp_path: Path, k: int) -> list[dict]:
    path = tmp_path / f"audit{k}" / f"run5-partition{k}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()]


# ---- callbacks run on the server only ----

def test_a_node_imports_no_callback_the_servers_config_names(grid, tmp_path, monkeypatch):
    marker = tmp_path / "imported"
    (tmp_path / f"{EVIL}.py").write_text(
        "from pathlib import Path\n"
        f"Path({str(marker)!r}).write_text('the server made a site run this')\n"
        "from protofl.engine.callbacks import Callback\n"
        "class Cb(Callback):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, EVIL, raising=False)
    cfg = config_from_dict(tiny(callbacks=[f"{EVIL}:Cb"]))
    cfg_json = json.dumps(cfg.to_dict(), sort_keys=True)
    g = grid()
    exp = client_app.node_experiment(cfg_json, g.contexts[11])
    assert exp.fed.spec.callbacks == [] and not marker.exists() and EVIL not in sys.modules
    run_on_grid(cfg, g, tmp_path / "run", node_wait=1)  # the nodes train without it
    assert EVIL in sys.modules  # the server loaded it: it runs there
    marker.unlink()
    monkeypatch.delitem(sys.modules, EVIL)
    for ctx in g.contexts.values():
        client_app.node_experiment(cfg_json, ctx)
    assert not marker.exists()


# ---- what leaves a site ----

def test_under_secure_sums_a_node_sends_no_sample_count(grid, tmp_path):
    """privacy.secagg in process (the plain Flower trainer carries the contributions): the
    train replies hold only the contribution and the loss, the audit log says so."""
    cfg = config_from_dict(tiny(privacy={"secagg": True, "secagg_max_weight": 200.0}))
    exp = run_on_grid(cfg, grid(), tmp_path / "run", node_wait=1)
    assert exp.round == 2 and exp.trainer.name == "flower-secagg"
    for k in range(CLIENTS):
        lines = audit_lines(tmp_path, k)
        assert lines[0]["message"] == "query" and lines[0]["entries"] == {
            "partition-id": "int", "num-partitions": "int"}
        train = [x for x in lines if x["message"] == "train"]
        assert [x["round"] for x in train] == [1, 2]
        for x in train:  # inside the masked vector: the contribution (its count) and the loss
            assert set(x["entries"]) == {*exp.aggregation.reply_spec(), "loss"}
            assert x["secure"] is True and x["noised"] is False
            assert x["entries"]["members"] == [[1], "float64"]  # as the arrays travel


def test_audit_log_has_one_line_per_message_with_shapes_and_no_values(grid, tmp_path):
    """fedproto: personalised, so the nodes score their own models (evaluate messages)."""
    exp = run_on_grid(config_from_dict(tiny("fedproto")), grid(), tmp_path / "run",
                      node_wait=1)
    lines = audit_lines(tmp_path, 0)
    assert [x["message"] for x in lines] == ["query", "train", "evaluate", "train", "evaluate"]
    train = lines[1]
    assert train["round"] == 1 and train["secure"] is False and train["noised"] is False
    assert train["entries"]["num-examples"] == "int"  # plain mode: the count is sent
    c, d = exp.data.num_classes, exp.alg.model.feature_dim
    assert train["entries"]["upload.protos"] == [[c, d], "float32"]
    assert train["entries"]["upload.counts"][0] == [c]
    assert lines[2]["round"] == 1
    assert lines[2]["entries"] == {"confusion": [[c, c], "int64"], "loss_sum": [[], "float64"]}


def test_describe_under_privacy_reports_only_whether_a_site_holds_data(grid):
    g = grid()
    for privacy, want in (({}, {"num-examples", "num-test"}), ({"secagg": True}, {
            "num-examples"}), ({"noise_multiplier": 1.0}, {"num-examples"})):
        cfg = config_from_dict(tiny(privacy=privacy))
        query = {"config": json.dumps(cfg.to_dict(), sort_keys=True)}
        info = client_app.describe_info(query, g.contexts[12])
        assert set(info) - {"partition-id", "num-partitions"} == want
        if privacy:
            assert info["num-examples"] == 1


# ---- versions ----

def test_a_node_of_another_protofl_minor_version_is_refused_and_left_out(grid, tmp_path,
                                                                         caplog):
    mine = node.protofl_version()
    major, minor = mine.split(".")[:2]
    other = f"{major}.{int(minor) + 1}.0"
    g = grid(versions={13: other, 12: f"{major}.{minor}.99"})  # a patch release is fine
    with caplog.at_level(logging.WARNING, "protofl"):
        exp = run_on_grid(config_from_dict(tiny()), g, tmp_path / "run", node_wait=1)
    assert sorted(exp.trainer.nodes) == [0, 1]
    assert f"node 13 left out (it cannot join): ProtoflError: flower: version mismatch: " \
           f"the server runs protofl {mine}, this node {other}" in caplog.text
    assert "no SuperNode for clients [2]" in caplog.text


def test_check_versions_by_hand(monkeypatch):
    cfg_json = json.dumps(config_from_dict(tiny()).to_dict(), sort_keys=True)
    sent = node.versions(cfg_json)
    node.check_versions(sent, cfg_json)
    with pytest.raises(ProtoflError, match="torch 1.13.1, this node"):
        node.check_versions({**sent, node.TORCH_VERSION: "1.13.1"}, cfg_json)
    node.check_versions({**sent, node.TORCH_VERSION: torch.__version__.split(".")[0] + ".99"})
    with pytest.raises(ProtoflError, match="does not match the hash"):
        node.check_versions(sent, cfg_json.replace('"rounds": 2', '"rounds": 3'))
    with pytest.raises(ProtoflError, match="sent no protofl/torch version"):
        node.check_versions(None)


# ---- a site's own settings ----

def test_a_node_keeps_its_own_device_threads_and_eval_batch(monkeypatch, caplog):
    cfg_json = json.dumps(config_from_dict(tiny(device="cuda", threads=4)).to_dict())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING, "flwr"):
        raw = json.loads(node.node_config_json(cfg_json, {}))
    assert raw["device"] == "cpu" and raw["threads"] == 4
    assert "device cuda is not available on this node; training on the CPU" in caplog.text
    raw = json.loads(node.node_config_json(cfg_json, {"device": "cpu", "threads": "1",
                                                      "eval-batch": "32"}))
    assert (raw["device"], raw["threads"], raw["metrics"]["eval_batch"]) == ("cpu", 1, 32)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert json.loads(node.node_config_json(cfg_json, {"device": "cuda:3"}))["device"] == "cpu"
    assert json.loads(node.node_config_json(cfg_json, {}))["device"] == "cuda"
    with pytest.raises(ProtoflError, match="must be integers"):
        node.node_config_json(cfg_json, {"threads": "many"})


# ---- what left each site, as `protofl audit` shows it (issue 50) ----

class RecordingGrid(LocalGrid):
    """Keeps every reply the server pulled, by node."""

    def __init__(self, *args):
        super().__init__(*args)
        self.received: dict[int, list[Message]] = {}

    def pull_messages(self, ids):
        got = super().pull_messages(ids)
        for m in got:
            self.received.setdefault(m.metadata.src_node_id, []).append(m)
        return got


def received_entries(msg: Message) -> tuple[str, dict]:
    """What a reply carried, described independently of the node's audit code: each array's
    shape and dtype, each plain value's type."""
    from protofl.flower.records import tree_from_records
    from protofl.nested import flatten

    content = msg.content
    if "node" in content.config_records:
        return "query", {k: type(v).__name__ for k, v in content.config_records["node"].items()}
    prefix = "upload" if any(k.startswith("upload") for k in content.array_records) else "eval"
    tree = tree_from_records(content, prefix)
    arrays = {(f"upload.{k}" if prefix == "upload" else k): [list(v.shape),
                                                           str(v.dtype).split(".")[-1]]
              for k, v in flatten(tree).items()}
    if prefix == "eval":
        return "evaluate", arrays
    metrics = {k: type(v).__name__ for k, v in content.metric_records["metrics"].items()}
    return "train", {**arrays, **metrics}


@pytest.mark.parametrize("algorithm", ["fedavg", "fedproto"])
def test_the_audit_logs_list_exactly_what_the_server_received(grid, tmp_path, capsys,
                                                              algorithm):
    from protofl.cli import main
    from protofl.flower import audit

    g = grid()
    g = RecordingGrid(g.contexts)
    run_on_grid(config_from_dict(tiny(algorithm)), g, tmp_path / "run", node_wait=1)
    for k in range(CLIENTS):
        log = tmp_path / f"audit{k}" / f"run5-partition{k}.jsonl"
        lines = audit.read(log)
        got = [received_entries(m) for m in g.received[11 + k]]
        assert [(x["message"], x["entries"]) for x in lines] == got
        assert {kind for kind, _ in got} == ({"query", "train", "evaluate"}
                                             if algorithm == "fedproto" else {"query", "train"})
    assert main(["audit", str(tmp_path / "audit0")]) == 0
    out = capsys.readouterr().out.splitlines()
    kinds = "query 1, train 2, evaluate 2" if algorithm == "fedproto" else "query 1, train 2"
    assert out[0].endswith(f"run5-partition0.jsonl: {len(out) - 1} messages sent ({kinds}); "
                           "names, shapes and types only, never values")
    assert " train    round   1: upload." in out[2] and "loss float" in out[2]
    (tmp_path / "bad.jsonl").write_text('{"message": "train"}\n')
    assert main(["audit", str(tmp_path / "bad.jsonl")]) == 2
    assert "bad.jsonl:1 is not an audit line" in capsys.readouterr().err
