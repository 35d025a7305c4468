import getpass
import os
import tempfile

import pytest
import torch

# tests never read or fill the user's data cache (~/.cache/protofl); set before any test so
# that the processes tests start (Ray workers, SuperNodes) inherit it
os.environ.setdefault("PROTOFL_CACHE", tempfile.mkdtemp(prefix="protofl-test-cache-"))
# trainer: auto reads engine/costs.py's constants in tests (deterministic, no timing)
os.environ["PROTOFL_CALIBRATE"] = "0"
# ... and torch's compile cache where it was (warm between test sessions), not in the temp cache
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"))


# The longest modules first (each several minutes on 2 cores): with ``-n 2 --dist loadfile``
# (the README's test command) a worker takes whole modules in this order, so no long module
# starts last while the other worker idles. Only the order of modules changes.
LONGEST_FIRST = ("test_docs_examples", "test_flower", "test_seg_run", "test_device",
                 "test_flower_deployment_faults", "test_conformance", "test_pretrain",
                 "test_flower_walkthrough", "test_vectorized", "test_suite_ray",
                 "test_hetero_flower")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rpartition(".")[2],
                                         len(rank)))


@pytest.fixture(autouse=True)
def _one_thread():
    """Tests are tiny: one intra-op thread is fastest and keeps runs deterministic."""
    torch.set_num_threads(1)
    yield


@pytest.fixture
def no_lead(monkeypatch):
    """Threads made not to pay, so no client of a round leads on every core (the parallel
    trainer's lead): every client trains on one thread, and the parallel trainer's numbers
    are the sequential trainer's bit for bit (a lead client's agree within 1e-6 in float32,
    its sums split over threads: ``test_parallel``)."""
    from protofl.engine import costs

    monkeypatch.setitem(costs.CPU, "thread_gain", 0.0)


@pytest.fixture
def kill_after(monkeypatch):
    """``with kill_after(n):`` a run is killed (KeyboardInterrupt) as it starts round n + 1,
    after round n is written; ``Experiment.step`` is itself again after the block."""
    from contextlib import contextmanager

    from protofl.engine.experiment import Experiment

    real = Experiment.step

    @contextmanager
    def killing(rounds: int):
        def dying(self):
            if self.round == rounds:
                raise KeyboardInterrupt
            return real(self)

        monkeypatch.setattr(Experiment, "step", dying)
        try:
            yield
        finally:
            monkeypatch.setattr(Experiment, "step", real)

    return killing


@pytest.fixture
def tiny_digits():
    """Run 2 rounds of an algorithm on digits (4 clients, 2 active, 2 local steps); returns
    the finished Experiment and its summary."""
    from protofl.config import config_from_dict
    from protofl.engine.experiment import Experiment

    def run(algorithm: str, algo: dict | None = None):
        cfg = config_from_dict({"algorithm": algorithm, "rounds": 2, "checkpoint_every": 0,
                                "data": {"name": "digits", "num_clients": 4},
                                "clients": {"per_round": 2, "local_steps": 2},
                                "metrics": {"dissimilarity_clients": 2}, "algo": algo or {}})
        exp = Experiment(cfg)
        return exp, exp.run()

    return run


@pytest.fixture
def float64():
    """Tensors in float64 for the test (the trainers' equivalence at 1e-9)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)
