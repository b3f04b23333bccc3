"""A cluster's token issuer and an S3 store with STS, on loopback, for the web-identity tests.

* `OidcIssuer`: what a cluster's service-account issuer publishes (OpenID discovery at
  ``/.well-known/openid-configuration``, the JWKS of one P-256 key), and tokens it signs (ES256)
  as the kubelet projects them into a pod; or tokens signed by another key, or expired.
* `start_sts_store`: SeaweedFS (Apache-2.0, built by scripts/build-seaweedfs.sh) as one process:
  master, volume server, filer and S3 gateway on 127.0.0.1, its IAM trusting that issuer (the
  audience `AUDIENCE`, discovered keys) for one role, `ROLE_ARN`, which may read one bucket and
  only for one subject, `SUBJECT`. Its STS answers ``AssumeRoleWithWebIdentity`` on the S3 port.
  An admin user's keys (`S3Keys`) put objects in through the S3 API (`S3Server`).

Both run until stopped; the store as a child that dies with its parent (`processes`).
"""

from __future__ import annotations

import base64
import http.server
import json
import secrets
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ec

from lorafleet_dev.processes import ChildProcess, HarnessError, built_bin_dir, free_port
from lorafleet_dev.storage_servers import STARTUP_TIMEOUT_S, S3Keys, S3Server, es256_jwk, sign_es256_jwt

BUILD_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build-seaweedfs.sh"
AUDIENCE = "sts.amazonaws.com"  # what EKS projects service-account tokens for
SUBJECT = "system:serviceaccount:team-a:lorafleet-agent"
PROVIDER = "cluster"
ROLE_ARN = "arn:aws:iam::role/adapter-reader"
# The listeners of one `weed server` besides S3's own: master, volume and filer over HTTP, and
# each one's gRPC, which `weed server` also serves on /tmp/seaweedfs-NAME-grpc-PORT.sock.
_HTTP_PORTS = ("master", "volume", "filer")
_GRPC_PORTS = ("master", "volume", "filer", "s3")


def seaweedfs_bin_dir() -> Path:
    """The built ``weed`` binary's directory (``LORAFLEET_SEAWEEDFS_BIN_DIR`` overrides);
    HarnessError naming the build script when it is not built (nothing is built here)."""
    return built_bin_dir(BUILD_SCRIPT, "LORAFLEET_SEAWEEDFS_BIN_DIR", ("weed",), "S3 store with STS (SeaweedFS)", "about 10 minutes")


class OidcIssuer(http.server.ThreadingHTTPServer):
    """A service-account token issuer on 127.0.0.1: its discovery document and JWKS, and the
    tokens it signs. Every path requested is kept in `seen`."""

    daemon_threads = True
    KEY_ID = "cluster-key"

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _IssuerHandler)
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.seen: list[str] = []
        threading.Thread(target=self.serve_forever, name="oidc-issuer", daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def token(self, subject: str = SUBJECT, *, key: ec.EllipticCurvePrivateKey | None = None, expires_in_s: int = 3600) -> str:
        """A projected service-account token for `subject` (signed with another `key` when given;
        a negative `expires_in_s`: already expired)."""
        now = int(time.time())
        claims = {"iss": self.url, "sub": subject, "aud": AUDIENCE, "iat": min(now, now + expires_in_s - 60), "exp": now + expires_in_s}
        return sign_es256_jwt(key or self.key, self.KEY_ID, claims)

    def answer(self, path: str) -> dict[str, Any] | None:
        """The document at `path` (None: not one of the issuer's)."""
        if path == "/.well-known/openid-configuration":
            return {"issuer": self.url, "jwks_uri": f"{self.url}/keys", "id_token_signing_alg_values_supported": ["ES256"]}
        if path == "/keys":
            return {"keys": [es256_jwk(self.key, self.KEY_ID)]}
        return None

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class _IssuerHandler(http.server.BaseHTTPRequestHandler):
    server: OidcIssuer

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.server.seen.append(self.path)
        document = self.server.answer(self.path)
        if document is None:
            self.send_error(404)
            return
        body = json.dumps(document).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _iam_config(issuer: OidcIssuer, bucket: str) -> dict[str, Any]:
    """The store's IAM: STS trusting the issuer's tokens for `AUDIENCE`, and one role that
    `SUBJECT` may assume, which reads `bucket`'s objects and nothing else."""
    trust = {
        "Effect": "Allow",
        "Principal": {"Federated": PROVIDER},
        "Action": ["sts:AssumeRoleWithWebIdentity"],
        "Condition": {"StringEquals": {"oidc:sub": SUBJECT}},
    }
    read = {"Effect": "Allow", "Action": ["s3:GetObject"], "Resource": [f"arn:aws:s3:::{bucket}/*"]}
    return {
        "sts": {
            "tokenDuration": "1h",
            "maxSessionLength": "12h",
            "issuer": "seaweedfs-sts",
            "signingKey": base64.b64encode(secrets.token_bytes(32)).decode(),
        },
        "providers": [{"name": PROVIDER, "type": "oidc", "enabled": True, "config": {"issuer": issuer.url, "clientId": AUDIENCE}}],
        "policy": {"defaultEffect": "Deny", "storeType": "memory"},
        "roles": [
            {
                "roleName": ROLE_ARN.rpartition("/")[2],
                "roleArn": ROLE_ARN,
                "trustPolicy": {"Version": "2012-10-17", "Statement": [trust]},
                "attachedPolicies": ["read-adapters"],
            }
        ],
        "policies": [{"name": "read-adapters", "document": {"Version": "2012-10-17", "Statement": [read]}}],
    }


def _s3_answers(port: int) -> bool:
    """Whether the S3 gateway answers HTTP (any status: an anonymous request is refused)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


@dataclass
class StsStore(S3Server):
    """SeaweedFS's S3 gateway, whose STS answers on the same port; stopping it also removes the
    gRPC sockets `weed server` leaves in /tmp."""

    sockets: tuple[Path, ...] = ()

    def stop(self) -> None:
        super().stop()
        for path in self.sockets:
            path.unlink(missing_ok=True)


def _server_argv(weed: Path, base: Path, s3_port: int, grpc_ports: dict[str, int]) -> list[str]:
    """`weed server` on 127.0.0.1 only, every port chosen, its sockets and data under ``base``,
    no telemetry, no side services; the S3 gateway with the identities and IAM under ``base``."""
    argv = [str(weed), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={base / 'seaweedfs'}", "-volume.max=4"]
    argv += ["-master.telemetry=false", "-filer", "-s3", "-s3.iam=false", "-s3.port.iceberg=0", "-s3.port.lance=0"]
    argv += [f"-{name}.port={free_port()}" for name in _HTTP_PORTS] + [f"-{name}.port.grpc={port}" for name, port in grpc_ports.items()]
    argv += [f"-s3.port={s3_port}", f"-filer.localSocket={base / 'filer.sock'}", f"-s3.localSocket={base / 's3.sock'}"]
    return [*argv, f"-s3.config={base / 's3.json'}", f"-s3.iam.config={base / 'iam.json'}"]


def start_sts_store(base: Path, keys: S3Keys, issuer: OidcIssuer, bucket: str) -> StsStore:
    """SeaweedFS over a fresh directory under ``base``, its IAM trusting `issuer`, `keys` an
    admin's, `bucket` created; ready to answer S3 and STS on one port."""
    weed = seaweedfs_bin_dir() / "weed"
    (base / "seaweedfs").mkdir(parents=True)
    admin = {"name": "admin", "credentials": [{"accessKey": keys.access_key_id, "secretKey": keys.secret_access_key}], "actions": ["Admin"]}
    (base / "s3.json").write_text(json.dumps({"identities": [admin]}))
    (base / "iam.json").write_text(json.dumps(_iam_config(issuer, bucket)))
    port, grpc_ports = free_port(), {name: free_port() for name in _GRPC_PORTS}
    process = ChildProcess.spawn("seaweedfs", _server_argv(weed, base, port, grpc_ports), base)
    sockets = tuple(Path(f"/tmp/seaweedfs-{name}-grpc-{grpc}.sock") for name, grpc in grpc_ports.items())
    server = StsStore(process, port, keys, sockets)
    try:
        process.wait_until("the SeaweedFS S3 gateway to answer", lambda: _s3_answers(port), STARTUP_TIMEOUT_S)
        process.wait_until(f"SeaweedFS to create the bucket {bucket}", lambda: _created(server, bucket), STARTUP_TIMEOUT_S)
    except BaseException:
        server.stop()
        raise
    return server


def _created(server: S3Server, bucket: str) -> bool:
    """Create `bucket` (the filer may still be joining the master: False until it is there)."""
    try:
        server.create_bucket(bucket)
    except HarnessError:  # not ready yet: wait_until tries again, then names what it waited for
        return False
    return True
