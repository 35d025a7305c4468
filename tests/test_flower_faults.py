"""A federation that survives a site going away (issue 50): the ``min-replies`` round policy
over a grid whose nodes leave and come back, run fast in this process (the nodes are
protofl's ClientApp handlers, as in tests/test_flower_node.py); the same faults on a real
SuperLink and SuperNodes are tests/test_flower_deployment_faults.py."""

from __future__ import annotations

import copy
import logging

import pytest

pytest.importorskip("flwr", reason="flwr is not installed (pip install 'protofl[flower]')")

from flwr.app import Context, Error, Message, RecordDict  # noqa: E402
from test_flower_node import CLIENTS, TaskIdentity, tiny  # noqa: E402
from test_flower_node import LocalGrid as NodesInProcess  # noqa: E402

from protofl.config import config_from_dict  # noqa: E402
from protofl.engine import runfolder  # noqa: E402
from protofl.engine.callbacks import Callback  # noqa: E402
from protofl.errors import ProtoflError  # noqa: E402
from protofl.flower.server_app import min_replies_of, run_on_grid  # noqa: E402

SUPERLINK = 1  # the node id under which the SuperLink answers for a node it cannot reach


class FaultyGrid(NodesInProcess):
    """Nodes that leave and come back: ``plan(round, attempt) -> {node: "gone" | "silent"}``
    (gone: not connected, the SuperLink answers for it; silent: connected, never replies;
    ``attempt``: how many times the round's jobs were sent before). A node that comes back
    may have a new id (``renamed``: old id -> (from round, new id))."""

    def __init__(self, contexts, plan, renamed=None):
        super().__init__(contexts)
        self.plan, self.renamed, self.round = plan, renamed or {}, 1
        self.tries: dict[int, int] = {}
        self.sent: list[tuple[int, str, int]] = []  # (round, message type, node id)

    def state(self, node: int) -> str:
        return self.plan(self.round, self.tries.get(self.round, 0)).get(node, "up")

    def node_id(self, node: int) -> int:
        start, new = self.renamed.get(node, (None, node))
        return new if start is not None and self.round >= start else node

    def get_node_ids(self) -> list[int]:
        return [self.node_id(n) for n in self.contexts if self.state(n) != "gone"]

    def push_messages(self, msgs: list[Message]) -> list[str]:
        ids = []
        for m in msgs:
            dst = m.metadata.dst_node_id
            home = next((n for n in self.contexts if self.node_id(n) == dst), None)
            self.sent.append((self.round, m.metadata.message_type, dst))
            if home is not None and self.state(home) == "up":
                sent = copy.deepcopy(m)
                sent.metadata.__dict__["_dst_node_id"] = home
                (mid,) = super().push_messages([sent])
                self.replies[mid].metadata.__dict__["_src_node_id"] = dst
            else:
                mid = f"lost-{len(self.sent)}"
                m.metadata.__dict__["_message_id"] = mid
                if home is None or self.state(home) == "gone":  # the SuperLink's error reply
                    reply = Message(Error(code=0, reason="node unavailable"), reply_to=m)
                    reply.metadata.__dict__["_src_node_id"] = SUPERLINK
                    self.replies[mid] = reply
            ids.append(mid)
        if any(m.metadata.message_type == "train" for m in msgs):
            self.tries[self.round] = self.tries.get(self.round, 0) + 1
        return ids


class Advance(Callback):
    """Tells the grid which round comes next (its plan is by round)."""

    def __init__(self, grid: FaultyGrid):
        self.grid = grid

    def on_round_end(self, exp, record):
        self.grid.round = record["round"] + 1


@pytest.fixture
def faulty(monkeypatch, tmp_path):
    for key, value in (("_run_id", 5), ("_node_id", 1), ("_task_id", 1)):
        if TaskIdentity is not None:
            monkeypatch.setattr(TaskIdentity, key, value)

    def make(plan, renamed=None) -> FaultyGrid:
        contexts = {11 + k: Context(5, 11 + k, {"partition-id": k, "num-partitions": CLIENTS,
                                                "audit-dir": str(tmp_path / f"audit{k}")},
                                    RecordDict(), {}) for k in range(CLIENTS)}
        return FaultyGrid(contexts, plan, renamed)

    return make


def run(grid, out, rounds=3, **kw):
    return run_on_grid(config(rounds), grid, out, node_wait=1, callbacks=[Advance(grid)],
                       **{"round_timeout": 5, **kw})


def rounds(out) -> list[int]:
    return [r["round"] for r in runfolder.read_metrics(out)]


def config(rounds: int = 3):
    return config_from_dict({**tiny(), "rounds": rounds, "checkpoint_every": 1})


def test_a_node_gone_for_a_round_is_left_out_and_no_reply_is_misattributed(faulty, tmp_path,
                                                                           caplog):
    grid = faulty(lambda t, _: {12: "gone"} if t == 2 else {})
    exp = run(grid, tmp_path / "run")
    rows = runfolder.read_metrics(tmp_path / "run")
    assert [r["clients"] for r in rows] == [[0, 1, 2], [0, 2], [0, 1, 2]]
    assert rows[1]["rejected"] == [1] and exp.round == 3
    assert "client 1 (node 12) left out: error reply: node unavailable" in caplog.text
    assert "unexpected node" not in caplog.text
    assert runfolder.RunStore(tmp_path / "run").problems() == []


def test_a_site_back_under_a_new_node_id_takes_its_client_over(faulty, tmp_path, caplog):
    # node 12 gone in rounds 2-3, back in round 4 as node 22
    grid = faulty(lambda t, _: {12: "gone"} if t in (2, 3) else {}, renamed={12: (4, 22)})
    run(grid, tmp_path / "run", rounds=4)
    rows = runfolder.read_metrics(tmp_path / "run")
    assert [r["clients"] for r in rows] == [[0, 1, 2], [0, 2], [0, 2], [0, 1, 2]]
    assert "client 1 is back, on node 22 (node 12 left)" in caplog.text
    assert (4, "train", 22) in grid.sent


def test_every_node_gone_retries_the_round_once_then_stops_in_one_line(faulty, tmp_path,
                                                                       caplog):
    grid = faulty(lambda t, _: {n: "gone" for n in (11, 12, 13)} if t >= 2 else {})
    flwr_lines = []
    handler = logging.Handler()
    handler.emit = lambda record: flwr_lines.append(record.getMessage())
    logging.getLogger("flwr").addHandler(handler)
    try:
        with pytest.raises(ProtoflError) as e:
            run(grid, tmp_path / "run", rounds=4)
    finally:
        logging.getLogger("flwr").removeHandler(handler)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("flower: round 2: 0 of 3 clients replied, twice")
    assert "min-replies = 1" in msg and "resume=true" in msg
    assert [t for t, kind, _ in grid.sent if kind == "train"] == [1] * 3 + [2] * 6
    # the folder: round 1 complete and checkpointed, nothing of round 2, no summary
    out = tmp_path / "run"
    assert rounds(out) == [1] and runfolder.load_checkpoint(out)["round"] == 1
    assert not (out / runfolder.SUMMARY).exists()
    assert runfolder.RunStore(out).problems() == []
    # the warnings reached Flower's log (what `flwr run --stream` shows), not only flower.log
    assert any("round 2: 0 of 3 clients replied, fewer than min-replies = 1; the round is "
               "sent once more" in line for line in flwr_lines), flwr_lines
    assert "sent once more" in (out / "flower.log").read_text()
    assert f"protofl: error: {msg}" in (out / "flower.log").read_text()
    assert sum(msg in line for line in flwr_lines) == 0  # serve() streams it, once


def test_min_replies_zero_keeps_the_state_when_nothing_came(faulty, tmp_path):
    grid = faulty(lambda t, _: {n: "gone" for n in (11, 12, 13)} if t == 2 else {})
    exp = run(grid, tmp_path / "run", min_replies=0)
    rows = runfolder.read_metrics(tmp_path / "run")
    assert exp.round == 3 and rows[1]["clients"] == [] and rows[1]["rejected"] == [0, 1, 2]
    assert rows[1]["accuracy"] == rows[0]["accuracy"]  # nothing aggregated: the same model


def test_a_retry_aggregates_a_node_that_came_back_in_between(faulty, tmp_path):
    """min-replies = 3: round 2's first try misses the silent node 13; by the second try it
    answers, so the round aggregates all three."""
    grid = faulty(lambda t, attempt: {13: "silent"} if (t, attempt) == (2, 0) else {})
    run(grid, tmp_path / "run", rounds=2, round_timeout=2, min_replies=3)
    rows = runfolder.read_metrics(tmp_path / "run")
    assert rows[1]["clients"] == [0, 1, 2] and rows[1]["rejected"] == []
    assert [t for t, kind, _ in grid.sent if kind == "train"] == [1] * 3 + [2] * 6


@pytest.mark.parametrize("value, ok", [(1, 1), ("0", 0), ("3", 3), (-1, None), ("x", None),
                                       (1.5, None)])
def test_min_replies_of_the_run_config(value, ok):
    if ok is None:
        with pytest.raises(ProtoflError, match="min-replies"):
            min_replies_of(value)
    else:
        assert min_replies_of(value) == ok
