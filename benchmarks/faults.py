"""The fault cases of issue 50, one line each: ``[fault] <case>: ok (X s)`` or
``[fault] <case>: FAILED <why> (X s)``.

Each case is the test that proves it (run through pytest, so there is one implementation of
each): a changed or corrupted run folder refused (integrity), the messages that misled, the
memory guard's feature sizes, a federation whose sites go away (in one process; with
``--deployment`` also on a SuperLink and three SuperNodes on 127.0.0.1, minutes), the sites'
audit logs, and (``--ray``) suites on a two-node Ray cluster on 127.0.0.1.

    python benchmarks/faults.py                 # integrity, messages, memory, Flower (~3 min)
    python benchmarks/faults.py --deployment    # + the deployment faults (~10 min)
    python benchmarks/faults.py --ray           # + suites on a 2-node Ray cluster (~5 min)

Exit code 0 when every case is ok, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CASES = {  # the case's name -> the test (a pytest node id, without its parameters: all run)
    "integrity: every file recorded in the manifest": "tests/test_integrity.py::"
    "test_a_finished_folder_verifies_and_records_every_file",
    "integrity: a hand-edited config.json": "tests/test_integrity.py::"
    "test_a_hand_edited_config_is_refused_naming_the_settings",
    "integrity: a flipped bit in the checkpoint": "tests/test_integrity.py::"
    "test_a_flipped_bit_in_the_checkpoint_is_refused_not_blamed_on_the_lr",
    "integrity: an edited metric line, summary or weights": "tests/test_integrity.py::"
    "test_an_edited_metric_line_or_summary_is_refused_by_compare_and_report",
    "integrity: a change of settings on resume": "tests/test_integrity.py::"
    "test_a_deliberate_change_on_resume_is_recorded_and_fixed_settings_are_refused",
    "integrity: a kill between manifest and checkpoint": "tests/test_integrity.py::"
    "test_a_kill_between_the_manifest_and_the_checkpoint_still_resumes_exactly",
    "integrity: a folder written before manifests": "tests/test_integrity.py::"
    "test_a_folder_written_before_manifests_is_read_with_a_warning_and_gets_one",
    "message: fedgen's noise_dim": "tests/test_bad_inputs.py::"
    "test_fedgen_noise_dim_is_named_when_it_is_what_is_too_large",
    "message: --out naming a folder of runs": "tests/test_bad_inputs.py::"
    "test_out_naming_a_folder_of_runs_says_so_and_leaves_it_untouched",
    "message: --resume --rounds 0": "tests/test_bad_inputs.py::"
    "test_resume_with_rounds_below_the_checkpoint_is_one_line_without_a_warning",
    "message: an empty --out": "tests/test_bad_inputs.py::"
    "test_an_empty_out_is_refused_not_replaced_by_the_default",
    "memory: feature_dim on every family": "tests/test_bad_inputs.py::"
    "test_feature_dim_on_every_family_is_sized_with_what_the_run_holds",
    "memory: the estimate is a lower bound": "tests/test_bad_inputs.py::"
    "test_the_estimate_is_a_lower_bound_of_what_a_run_holds",
    "flower: a node gone for a round": "tests/test_flower_faults.py::"
    "test_a_node_gone_for_a_round_is_left_out_and_no_reply_is_misattributed",
    "flower: a site back under a new node id": "tests/test_flower_faults.py::"
    "test_a_site_back_under_a_new_node_id_takes_its_client_over",
    "flower: every node gone": "tests/test_flower_faults.py::"
    "test_every_node_gone_retries_the_round_once_then_stops_in_one_line",
    "flower: a retry that gets the late node": "tests/test_flower_faults.py::"
    "test_a_retry_aggregates_a_node_that_came_back_in_between",
    "flower: min-replies 0": "tests/test_flower_faults.py::"
    "test_min_replies_zero_keeps_the_state_when_nothing_came",
    "audit: the logs list what the server received": "tests/test_flower_node.py::"
    "test_the_audit_logs_list_exactly_what_the_server_received",
}
DEPLOYMENT = {
    "deployment: killed, late and returning SuperNodes": "tests/"
    "test_flower_deployment_faults.py::test_a_killed_a_late_and_a_returning_supernode",
    "deployment: every SuperNode gone, then resume=true": "tests/"
    "test_flower_deployment_faults.py::"
    "test_every_supernode_gone_stops_the_run_and_resume_continues_it",
}
RAY = {
    "ray: a suite on a 2-node cluster, a node killed": "tests/test_suite_ray.py::"
    "test_a_suite_on_a_two_node_cluster_survives_a_killed_node",
    "ray: Flower's simulation on the cluster": "tests/test_suite_ray.py::"
    "test_flower_simulation_on_the_cluster",
}


class Lines:
    """A pytest plugin printing one ``[fault]`` line per test (per parameter set)."""

    def __init__(self, names: dict[str, str]):
        self.names = {node.split("::")[-1]: name for name, node in names.items()}
        self.failed = 0

    def pytest_runtest_logreport(self, report) -> None:
        if report.when != "call" and not (report.failed or report.skipped):
            return
        if report.when == "teardown" and report.passed:
            return
        test = report.nodeid.split("::")[-1]
        base, _, params = test.partition("[")
        case = self.names.get(base, base) + (f" [{params[:-1]}]" if params else "")
        if report.passed:
            print(f"[fault] {case}: ok ({report.duration:.1f} s)", flush=True)
        elif report.skipped:
            why = report.longrepr[-1] if isinstance(report.longrepr, tuple) else "skipped"
            print(f"[fault] {case}: FAILED skipped: {why}", flush=True)
            self.failed += 1
        else:
            lines = [x for x in str(report.longrepr).splitlines() if x.startswith("E ")]
            why = (lines[0][1:].strip() if lines else "error")[:200]
            print(f"[fault] {case}: FAILED {why} ({report.duration:.1f} s)", flush=True)
            self.failed += 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deployment", action="store_true", help="also the deployment faults "
                   "(a SuperLink and three SuperNodes on 127.0.0.1; minutes)")
    p.add_argument("--ray", action="store_true", help="also suites on a 2-node Ray cluster")
    args = p.parse_args()
    cases = {**CASES, **(DEPLOYMENT if args.deployment else {}), **(RAY if args.ray else {})}
    plugin = Lines(cases)
    os.chdir(ROOT)
    paths = [str(ROOT / "src"), str(ROOT / "tests")]
    sys.path[:0] = paths  # and for the processes the cases start (SuperNodes, Ray workers)
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [os.environ.get(
        "PYTHONPATH")])])
    start = time.perf_counter()
    pytest.main(["-p", "no:cacheprovider", "-p", "no:terminal", *cases.values()],
                plugins=[plugin])
    print(f"[fault] {len(cases)} cases, {plugin.failed} failed ({time.perf_counter() - start:.0f}"
          " s)")
    return 1 if plugin.failed else 0


if __name__ == "__main__":
    sys.exit(main())
