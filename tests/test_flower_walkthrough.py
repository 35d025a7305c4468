"""The three-site walkthrough (docs/how-to/flower-sites.md), run as written on 127.0.0.1: its
code blocks are read from the page and executed in order, with only what one test machine
must change
(``SUBSTITUTIONS``; three hospitals become three SuperNodes on one host, so each gets its own
runtime port and folder) and two additions the page describes in prose: each site's
``audit-dir``, and a fourth SuperNode whose protofl is another minor version (it must be
refused with one line and left out). The run is cut to 2 of the page's 50 rounds with the
``num-server-rounds`` the page names.

Checks: TLS and node authentication (the ServerApp's first line says both are on), the
three registrations, site data (each site's sample counts in flower.log, a federated
evaluation of every site), the audit logs and the refused site.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from deployment import BIN, OLD_VERSION, REPO, free_port, wait_for  # noqa: E402
from sitefiles import write_site  # noqa: E402

CLASSES = ["nevus", "melanoma", "keratosis"]
KINDS = ["bash", "bash", "toml", "bash", "bash", "yaml", "bash"]  # the page's blocks, in order


def blocks() -> list[tuple[str, str]]:
    text = (REPO / "docs" / "how-to" / "flower-sites.md").read_text()
    section = text.split("## A three-site walkthrough", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(\w+)\n(.*?)```", section, re.S)


def substitutions(tmp: Path, port: int) -> dict[str, str]:
    """What differs on one test machine (machine names, absolute paths, the port)."""
    return {"link.example.org": "127.0.0.1", ":9092": f":{port}", "--port 9092":
            f"--port {port}", "/srv/creds/": f"{tmp}/creds/", "/srv/derm-sites.yaml":
            f"{tmp}/derm-sites.yaml", "/srv/runs/derm": f"{tmp}/runs/derm",
            "/srv/derm-test": f"{tmp}/derm-test", "flwr run . ": f"flwr run {REPO} ",
            "--host 0.0.0.0": "--host 127.0.0.1",
            "scripts/flower-dev-certs.sh": f"bash {REPO}/scripts/flower-dev-certs.sh"}


def apply(text: str, subs: dict[str, str]) -> str:
    for old, new in subs.items():
        text = text.replace(old, new)
    return text


class Machine:
    """The commands of the page, run in ``tmp`` with the test's flwr home and PATH."""

    def __init__(self, tmp: Path):
        self.tmp, self.procs = tmp, []
        self.env = {**os.environ, "FLWR_HOME": str(tmp / "flwr_home"), "OMP_NUM_THREADS": "1",
                    "FLWR_DISABLE_UPDATE_CHECK": "1",
                    "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}

    def run(self, script: str, cwd: Path | None = None, timeout: float = 300) -> str:
        res = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd or self.tmp,
                             env=self.env, capture_output=True, text=True, timeout=timeout)
        assert res.returncode == 0, script + "\n" + res.stdout + res.stderr
        return res.stdout

    def start(self, name: str, script: str, cwd: Path | None = None,
              env: dict | None = None) -> None:
        log = open(self.tmp / f"{name}.log", "wb")
        self.procs.append(subprocess.Popen(["bash", "-c", "exec " + script.strip()],
                                           cwd=cwd or self.tmp, env=env or self.env,
                                           stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True))

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def down(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, 15)
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)


def old_protofl(tmp: Path) -> str:
    """A PYTHONPATH whose first entry says protofl is OLD_VERSION (the mismatched site)."""
    meta = tmp / "old_protofl" / f"protofl-{OLD_VERSION}.dist-info"
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: protofl\n"
                                   f"Version: {OLD_VERSION}\n")
    return os.pathsep.join([str(meta.parent), *filter(None, [os.environ.get("PYTHONPATH")])])


@pytest.mark.skipif(sys.platform == "win32", reason="process groups are POSIX-only")
def test_the_three_site_walkthrough_runs_as_written(tmp_path):
    if os.environ.get("PROTOFL_FLOWER_DEPLOYMENT", "1") == "0":
        pytest.skip("PROTOFL_FLOWER_DEPLOYMENT=0: deployment-engine tests (minutes) off")
    if not (shutil.which("openssl") and shutil.which("ssh-keygen")):
        pytest.skip("the development credentials need openssl and ssh-keygen")
    found = blocks()
    assert [k for k, _ in found] == KINDS, "the walkthrough's code blocks changed"
    port = free_port()
    certs, link, toml, register, supernode, yaml, run = (
        apply(b, substitutions(tmp_path, port)) for _, b in found)
    m = Machine(tmp_path)
    sites = [write_site(tmp_path / f"site{k}", dict.fromkeys(CLASSES, 4), CLASSES, size=16,
                        mode="RGB", seed=k) for k in range(3)]
    write_site(tmp_path / "derm-test", dict.fromkeys(CLASSES, 2), CLASSES, size=16,
               mode="RGB", seed=9)
    try:
        # 1. credentials: the page's script makes 3 key pairs; one more for the old site
        m.run(certs.replace(" creds 3 ", " creds 4 "))
        # 2. the SuperLink with TLS and node authentication
        m.start("superlink", link.replace("\\\n", " "))
        wait_for(lambda: _listening(port), 90, "the SuperLink")
        # 3. the connection and the registrations
        (tmp_path / "flwr_home").mkdir(exist_ok=True)  # (the SuperLink made it)
        (tmp_path / "flwr_home" / "config.toml").write_text(toml)
        listed = m.run(register + "\nflwr supernode register creds/supernode_4.pub "
                       "hospitals\n")
        assert listed.count("registered successfully") == 4, listed
        # 4. one SuperNode per hospital, as shown for hospital 1, plus the old one
        one = supernode.replace("\\\n", " ").strip()
        for k, site in enumerate(sites):
            cmd = (one.replace("partition-id=0", f"partition-id={k}")
                   .replace("supernode_1", f"supernode_{k + 1}")
                   .replace("/data/derm", str(site))
                   .replace("'\"", f"' audit-dir='{tmp_path / f'audit{k}'}'\"")
                   + f" --port {free_port()}")
            m.start(f"hospital{k + 1}", cmd, cwd=tmp_path / "creds")
        old = (one.replace("partition-id=0", "partition-id=2")
               .replace("supernode_1", "supernode_4").replace("/data/derm", str(sites[2]))
               + f" --port {free_port()}")
        m.start("old", old, cwd=tmp_path / "creds",
                env={**m.env, "PYTHONPATH": old_protofl(tmp_path)})
        wait_for(lambda: m.log("superlink").count("Activated node_id") >= 4, 180,
                 "the four SuperNodes to join")
        # 5. the run: the page's YAML, cut to 2 rounds by num-server-rounds
        (tmp_path / "derm-sites.yaml").write_text(yaml)
        m.run(run.replace("\\\n", " ").replace("out=", "num-server-rounds=2 node-wait=60.0 "
                                                      "out="), timeout=900)
        out = tmp_path / "runs" / "derm"
        summary = wait_for(lambda: (out / "summary.json").exists() and json.loads(
            (out / "summary.json").read_text()), 300, "summary.json", every=2)
    finally:
        m.down()
    assert summary["rounds"] == 2 and summary["dataset"] == "site"
    log = (out / "flower.log").read_text()
    assert log.splitlines()[0].endswith("federation: TLS on, SuperNode authentication on (from "
                                        "the SuperLink's command line)")
    for k in range(3):
        assert f"site {k} (node" in log
    assert (f"this node {OLD_VERSION}") in log and "left out" in log
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2] and rows[-1]["clients"] == [0, 1, 2]
    assert set(rows[-1]["client_accuracy"]) == {"0", "1", "2"}
    assert 0 <= rows[-1]["accuracy"] <= 1  # the coordinator's own test images
    for k in range(3):
        (path,) = (tmp_path / f"audit{k}").glob(f"run*-partition{k}.jsonl")
        sent = [json.loads(x)["message"] for x in path.read_text().splitlines()]
        assert sent[0] == "query" and sent.count("train") == 2 and "evaluate" in sent


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
