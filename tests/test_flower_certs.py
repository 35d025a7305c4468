"""scripts/flower-dev-certs.sh: the CA, server certificate and SuperNode keys it makes work
for a TLS handshake on 127.0.0.1 and load as Flower loads them (no Flower process started)."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import threading
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "flower-dev-certs.sh"
pytestmark = pytest.mark.skipif(not (shutil.which("openssl") and shutil.which("ssh-keygen")),
                                reason="needs openssl and ssh-keygen")


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    out = tmp_path_factory.mktemp("certs") / "c"
    r = subprocess.run(["bash", str(SCRIPT), str(out), "2"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "--enable-supernode-auth" in r.stdout
    return out


def handshake(certs: Path, server_hostname: str) -> bytes:
    """One TLS exchange on 127.0.0.1: the server presents server.pem, the client trusts only
    ca.crt and checks the name."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(certs / "server.pem", certs / "server.key")
    client_ctx = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)

        def serve():
            conn, _ = listener.accept()
            try:
                with server_ctx.wrap_socket(conn, server_side=True) as s:
                    s.sendall(b"ok")
            except (ssl.SSLError, OSError):  # the client refused the certificate
                conn.close()

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        with socket.create_connection(listener.getsockname()) as raw:
            with client_ctx.wrap_socket(raw, server_hostname=server_hostname) as s:
                got = s.recv(2)
        t.join(5)
    return got


def test_tls_handshake_with_the_dev_ca(certs):
    for name in ("127.0.0.1", "localhost"):  # both are in the certificate
        assert handshake(certs, name) == b"ok"
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(certs, "example.org")


def test_supernode_keys_are_what_flower_accepts(certs):
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import (
        load_ssh_private_key,
        load_ssh_public_key,
    )

    for i in (1, 2):
        key = load_ssh_private_key((certs / f"supernode_{i}").read_bytes(), password=None)
        pub = load_ssh_public_key((certs / f"supernode_{i}.pub").read_bytes())
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        assert isinstance(key.curve, ec.SECP384R1)
        assert pub.public_numbers() == key.public_key().public_numbers()


def test_existing_files_are_not_overwritten(certs):
    before = (certs / "ca.crt").read_bytes()
    r = subprocess.run(["bash", str(SCRIPT), str(certs), "1"], capture_output=True, text=True)
    assert r.returncode == 2 and "not overwriting" in r.stderr
    assert (certs / "ca.crt").read_bytes() == before


# ---- scripts/flower-prod-certs.sh: a passphrase-protected CA, a CSR signed by it ----

PROD = SCRIPT.with_name("flower-prod-certs.sh")


def prod(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(PROD), *map(str, args)], capture_output=True, text=True)


def test_superlink_certificate_from_a_passphrase_protected_ca(tmp_path):
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    d, phrase = tmp_path / "pki", tmp_path / "pass"
    phrase.write_text("correct horse battery staple\n")
    assert prod("ca", d, phrase).returncode == 0
    key = (d / "ca.key").read_bytes()
    assert key.startswith(b"-----BEGIN ENCRYPTED PRIVATE KEY-----")
    with pytest.raises(TypeError):  # unusable without the passphrase
        load_pem_private_key(key, password=None)
    load_pem_private_key(key, password=b"correct horse battery staple")
    assert prod("csr", d, "localhost,127.0.0.1").returncode == 0
    wrong = tmp_path / "wrong"
    wrong.write_text("guess\n")
    r = prod("sign", d / "ca.crt", d / "ca.key", wrong, d / "server.csr", d / "server.pem")
    assert r.returncode == 2 and "wrong passphrase" in r.stderr and not (d / "server.pem").exists()
    r = prod("sign", d / "ca.crt", d / "ca.key", phrase, d / "server.csr", d / "server.pem")
    assert r.returncode == 0, r.stderr
    for name in ("127.0.0.1", "localhost"):
        assert handshake(d, name) == b"ok"
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(d, "example.org")
    r = prod("sign", d / "ca.crt", d / "ca.key", phrase, d / "server.csr", d / "server.pem")
    assert r.returncode == 2 and "not overwriting" in r.stderr


def test_site_key_for_a_rotation(tmp_path):
    from cryptography.hazmat.primitives.serialization import load_ssh_public_key

    assert prod("site-key", tmp_path / "k" / "site1_2027", "site1").returncode == 0
    assert load_ssh_public_key((tmp_path / "k" / "site1_2027.pub").read_bytes()).curve.name \
        == "secp384r1"
    r = prod("site-key", tmp_path / "k" / "site1_2027")
    assert r.returncode == 2 and "not overwriting" in r.stderr
    assert prod("nonsense").returncode == 2
