"""A Flower deployment on 127.0.0.1 for the tests and benchmarks/flower_deploy.py: a SuperLink
with TLS and SuperNode authentication, and registered SuperNodes with their own site folders.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from protofl.config import Config

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # flwr's commands installed beside this interpreter
OLD_VERSION = "9.9.0"  # the protofl of the deployment's mismatched SuperNode


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
    """A SuperLink with TLS and SuperNode authentication, and two registered SuperNodes with
    their own site folders (each process in its own process group, so it can be killed with
    its ClientApp children). Credentials come from scripts/flower-dev-certs.sh."""

    def __init__(self, root: Path, database: bool = False):
        self.root, self.procs = root, {}
        # with a database the SuperLink keeps its registered nodes and runs across a restart
        self.database = root / "superlink.db" if database else None
        self.node_ids: list[str] = []  # the SuperLink's node id of each site's key
        self.node_configs: list[str] = []
        self.home = root / "flwr_home"
        self.home.mkdir()
        self.certs = root / "certs"
        res = subprocess.run(["bash", str(REPO / "scripts" / "flower-dev-certs.sh"),
                              str(self.certs), "5"], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        self.port = free_port()
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "test"\n\n[superlink.test]\n'
            f'address = "127.0.0.1:{self.port}"\n'
            f'root-certificates = "{self.certs / "ca.crt"}"\n')
        self.env = {**os.environ, "FLWR_HOME": str(self.home), "OMP_NUM_THREADS": "1",
                    "FLWR_DISABLE_UPDATE_CHECK": "1",  # the SuperLink starts flower-superexec:
                    "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}

    def start(self, name: str, cmd: list[str], env: dict | None = None) -> None:
        log = open(self.root / f"{name}.log", "wb")
        self.procs[name] = subprocess.Popen(cmd, env=env or self.env, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)

    def flwr(self, *args: str, timeout: float = 120) -> str:
        res = subprocess.run([str(BIN / "flwr"), *args], env=self.env, cwd=self.root,
                             capture_output=True, text=True, timeout=timeout)
        assert res.returncode == 0, res.stdout + res.stderr
        return res.stdout

    def supernode(self, name: str, key: str, node_config: str, env: dict | None = None
                  ) -> None:
        """A SuperNode authenticating with the private key ``certs/key``."""
        self.start(name, [str(BIN / "flower-supernode"),
                          "--superlink", f"127.0.0.1:{self.port}",
                          "--root-certificates", str(self.certs / "ca.crt"),
                          "--auth-supernode-private-key", str(self.certs / key),
                          "--host", "127.0.0.1", "--port", str(free_port()),
                          "--node-config", node_config], env)

    def superlink(self) -> None:
        """Start (or restart) the SuperLink and wait until it listens."""
        self.start("superlink", [str(BIN / "flower-superlink"),
                                 "--ssl-ca-certfile", str(self.certs / "ca.crt"),
                                 "--ssl-certfile", str(self.certs / "server.pem"),
                                 "--ssl-keyfile", str(self.certs / "server.key"),
                                 "--enable-supernode-auth",
                                 "--host", "127.0.0.1", "--port", str(self.port),
                                 "--disable-runtime-dependency-installation",
                                 *(["--database", str(self.database)] if self.database else [])])
        wait_for(lambda: self._listening(self.port), 60, "the SuperLink")

    def up(self, sites: list[Path], old: bool = True, extra: str = "") -> None:
        """The SuperLink, one registered SuperNode per site folder (``extra``: more node
        config) and (``old``) a SuperNode of another protofl version."""
        self.superlink()
        for k, site in enumerate(sites):
            out = self.flwr("supernode", "register", str(self.certs / f"supernode_{k + 1}.pub"),
                            "test")
            assert "registered successfully" in out, out
            self.node_ids.append(re.search(r"SuperNode (\d+) registered", out).group(1))
            self.node_configs.append(
                f"partition-id={k} num-partitions={len(sites)} data-root='{site}' "
                f"audit-dir='{self.root / f'audit{k}'}' {extra}".strip())
            self.supernode(f"node{k}", f"supernode_{k + 1}", self.node_configs[k])
        if old:
            self.old_site(sites[-1], len(sites))
        wait_for(lambda: self.log("superlink").count("Activated node_id") >= len(sites) + old,
                 120, "the SuperNodes to join")

    def old_site(self, site: Path, n: int) -> None:
        """A registered SuperNode whose protofl is another minor version (its metadata, first
        on its path, says 9.9.0): it must answer every run with one line and be left out."""
        meta = self.root / "old_protofl" / f"protofl-{OLD_VERSION}.dist-info"
        meta.mkdir(parents=True)
        (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: protofl\n"
                                       f"Version: {OLD_VERSION}\n")
        path = os.pathsep.join([str(meta.parent), *filter(None, [os.environ.get(
            "PYTHONPATH")])])
        out = self.flwr("supernode", "register", str(self.certs / "supernode_4.pub"), "test")
        assert "registered successfully" in out, out
        self.supernode("old", "supernode_4", f"partition-id={n - 1} num-partitions={n} "
                       f"data-root='{site}' audit-dir='{self.root / 'audit_old'}'",
                       {**self.env, "PYTHONPATH": path})

    @staticmethod
    def _listening(port: int) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    def flwr_run(self, cfg: Config, out: Path, round_timeout: float, extra: str = "",
                 node_wait: float = 60.0) -> int:
        """Start ``cfg`` on the federation (the ServerApp writes the run folder ``out``;
        ``extra``: more run config, e.g. ``resume=true``; ``node_wait``: how long the run
        waits for every client's SuperNode); the run's id."""
        path = out.with_name(out.name + ".json")
        path.write_text(json.dumps(cfg.to_dict()))
        overrides = (f'out="{out}" round-timeout={round_timeout} node-wait={node_wait} '
                     f'num-server-rounds={cfg.rounds} config="{path}" set="" {extra}').strip()
        out = self.flwr("run", str(REPO), "test", "--run-config", overrides)
        assert "Successfully started run" in out, out
        return int(re.search(r"Successfully started run (\d+)", out).group(1))

    def run_status(self, run_id: int) -> str:
        """The run's status as ``flwr ls`` shows it (e.g. ``finished:completed``)."""
        listed = json.loads(self.flwr("ls", "test", "--run-id", str(run_id), "--format", "json"))
        return listed["runs"][0]["status"]

    def run_log(self, run_id: int) -> str:
        """What ``flwr log`` shows of the run (the ServerApp's streamed output)."""
        return self.flwr("log", str(run_id), "test", "--show", timeout=60)

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
