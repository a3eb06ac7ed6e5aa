"""Test helper: a throwaway CA and server certificate made with the ``openssl`` CLI (for TLS routers
and TLS Redis in the security tests). Not a test module."""

from __future__ import annotations

import subprocess
from pathlib import Path


def make_tls_files(directory: Path) -> dict[str, str]:
    """A throwaway CA and a server certificate for 127.0.0.1 / localhost, made with the ``openssl`` CLI.
    Returns paths: ``ca``, ``cert``, ``key`` (PEM)."""
    d = Path(directory)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n"
                               "extendedKeyUsage=serverAuth\n")
    for argv in (["req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
                  "-subj", "/CN=pdserve test CA", "-addext", "basicConstraints=critical,CA:TRUE",
                  "-addext", "keyUsage=keyCertSign,cRLSign"],
                 ["req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1"],
                 ["x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                  "-out", "server.crt", "-days", "2", "-extfile", "ext.cnf"]):
        subprocess.run(["openssl", *argv], cwd=d, check=True, capture_output=True, timeout=30)
    return {"ca": str(d / "ca.crt"), "cert": str(d / "server.crt"), "key": str(d / "server.key")}
