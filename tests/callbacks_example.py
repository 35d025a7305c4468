"""A user's round callback, loaded by import path from a config (test_architecture.py)."""

from __future__ import annotations

from protofl.engine.callbacks import Callback


class GlobalNorm(Callback):
    """Logs the L2 norm of the aggregate model's weights on evaluation rounds."""

    def on_evaluate(self, exp, record):
        weights = exp.alg.global_weights(exp.state)
        if weights is not None:
            record["weight_norm"] = float(sum(v.pow(2).sum() for v in
                                              weights["params"].values()) ** 0.5)


class StopAfterFirstRound(Callback):
    """Ends a run after its first round (a test's run budget: ``rounds`` of 2^31 runs one)."""

    def stop_reason(self, view):
        return "the test's budget of one round"
