"""The ServerApp's first line: TLS and SuperNode authentication, read from the SuperLink's
command line among its ancestors (flower/link.py), on a /proc tree written here."""

from pathlib import Path

from protofl.flower.link import superlink_args, transport_line


def proc_tree(root: Path, procs: dict[int, tuple[int, list[str]]]) -> Path:
    """``root`` as /proc: per pid its PPid and argv."""
    for pid, (ppid, argv) in procs.items():
        d = root / str(pid)
        d.mkdir(parents=True)
        (d / "cmdline").write_bytes("\0".join(argv).encode() + b"\0")
        (d / "status").write_text(f"Name:\tx\nPid:\t{pid}\nPPid:\t{ppid}\n")
    return root


LINK = ["/usr/bin/python3", "/opt/venv/bin/flower-superlink", "--ssl-ca-certfile", "ca.crt",
        "--ssl-certfile", "server.pem", "--ssl-keyfile", "server.key",
        "--enable-supernode-auth"]


def test_the_superlink_is_found_through_parent_pids(tmp_path):
    # flwr-serverapp <- flower-superexec (detached: PPid 1, but --parent-pid names the link)
    proc = proc_tree(tmp_path, {
        300: (200, ["/opt/venv/bin/python", "/opt/venv/bin/flwr-serverapp", "--parent-pid",
                    "200"]),
        200: (1, ["/opt/venv/bin/python", "/opt/venv/bin/flower-superexec",
                  "--parent-pid=100"]),
        100: (1, LINK), 1: (0, ["/sbin/init"])})
    args = superlink_args(300, proc)
    assert args[:2] == LINK[:2]
    assert transport_line(False, args) == ("federation: TLS on, SuperNode authentication on "
                                           "(from the SuperLink's command line)")


def test_an_insecure_link_without_authentication_says_so(tmp_path):
    proc = proc_tree(tmp_path, {20: (10, ["flwr-serverapp"]),
                                10: (1, ["flower-superlink", "--insecure"]), 1: (0, ["init"])})
    assert transport_line(False, superlink_args(20, proc)) == (
        "federation: TLS OFF (--insecure), SuperNode authentication OFF (from the SuperLink's "
        "command line)")


def test_no_visible_superlink_is_unknown_and_simulation_is_named(tmp_path):
    proc = proc_tree(tmp_path, {20: (1, ["python", "serve.py"]), 1: (0, ["init"])})
    assert superlink_args(20, proc) is None
    assert superlink_args(99, proc) is None  # a pid that is gone
    assert "unknown" in transport_line(False, None)
    assert "simulation engine" in transport_line(True, None)
