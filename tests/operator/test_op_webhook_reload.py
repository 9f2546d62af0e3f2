"""The admission webhook's certificate follows its files without a restart (cert-manager renews the
Secret, the kubelet swaps the mounted files): the server the operator runs (admission.WebhookServer,
kopf's WebhookServer underneath) serves a new TLS connection with the new certificate; a pair that
does not load leaves the previous certificate serving; an AdmissionReview still gets its answer."""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import os
import ssl
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tilert_operator import admission
from tilert_serve.local.runner import free_port

HOST = "tpd-tilert-pd-webhook.ops.svc"


def make_cert(cn: str) -> tuple[bytes, bytes, bytes]:
    """A self-signed certificate for HOST (its own CA): (cert PEM, key PEM, cert DER)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(HOST)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))  # fmt: skip
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return (
        cert.public_bytes(serialization.Encoding.PEM),
        key_pem,
        cert.public_bytes(serialization.Encoding.DER),
    )


def mount(secret_dir: Path, cert: bytes, key: bytes) -> None:
    """Write the pair as the kubelet updates a Secret volume: a new timestamped directory, then one
    atomic swap of the `..data` symlink that tls.crt and tls.key point through."""
    stamp = f"..{datetime.datetime.now(datetime.UTC):%Y_%m_%d_%H_%M_%S.%f}"
    (secret_dir / stamp).mkdir()
    (secret_dir / stamp / "tls.crt").write_bytes(cert)
    (secret_dir / stamp / "tls.key").write_bytes(key)
    tmp = secret_dir / "..data_tmp"
    tmp.symlink_to(stamp)
    os.replace(tmp, secret_dir / "..data")
    for f in ("tls.crt", "tls.key"):
        if not (secret_dir / f).is_symlink():
            (secret_dir / f).symlink_to(f"..data/{f}")


async def served_cert(port: int, *, sni: bool = True) -> bytes:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    _, writer = await asyncio.wait_for(
        asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname=HOST if sni else None), 10
    )
    der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    writer.close()
    return bytes(der)


async def review(port: int, cert_pem: bytes) -> dict[str, Any]:
    """An AdmissionReview over HTTPS from a client that trusts only cert_pem and checks HOST."""
    ctx = ssl.create_default_context(cadata=cert_pem.decode())
    body = json.dumps(
        {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": "u1"}}
    ).encode()
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname=HOST), 10
    )
    writer.write(f"POST /validate-pdcluster HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)  # fmt: skip
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    return dict(json.loads(payload))


async def test_new_connections_get_the_renewed_certificate_without_a_restart(tmp_path: Path) -> None:
    secret = tmp_path / "webhook-tls"
    secret.mkdir()
    first, second, third = make_cert("first"), make_cert("second"), make_cert("third")
    mount(secret, first[0], first[1])
    port = free_port()
    server = admission.WebhookServer(addr="127.0.0.1", port=port, certfile=str(secret / "tls.crt"), pkeyfile=str(secret / "tls.key"),
                                     check_interval_s=0.0)  # fmt: skip

    async def fn(request: Any, **_: Any) -> Any:
        return {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "response": {"uid": request["request"]["uid"], "allowed": True},
        }

    serving = server(fn)
    try:
        await asyncio.wait_for(anext(serving), 30)
        assert await served_cert(port) == first[2]
        old_conn = await asyncio.open_connection(
            "127.0.0.1", port, ssl=ssl._create_unverified_context(), server_hostname=HOST
        )

        # Renewed: the next connection gets the new certificate, and a client trusting only the new
        # one (what cert-manager's CA injector gives the API server) is answered.
        mount(secret, second[0], second[1])
        assert await served_cert(port) == second[2]
        assert await served_cert(port, sni=False) == second[2]
        assert (await review(port, second[0]))["response"]["allowed"] is True
        # The connection opened before the renewal keeps its certificate.
        assert old_conn[1].get_extra_info("ssl_object").getpeercert(binary_form=True) == first[2]
        old_conn[1].close()

        # A pair that does not load (the third cert with the second key): the second keeps serving.
        mount(secret, third[0], second[1])
        assert await served_cert(port) == second[2]
        assert server.reloader is not None and server.reloader.failures == 1
        assert await served_cert(port) == second[2]
        assert server.reloader.failures == 1, "a refused pair is tried again only when the files change"
        # Fixed: the third pair serves.
        mount(secret, third[0], third[1])
        assert await served_cert(port) == third[2]
        assert server.reloader.reloads == 2
    finally:
        await serving.aclose()


async def test_checks_are_rate_limited(tmp_path: Path) -> None:
    secret = tmp_path / "tls"
    secret.mkdir()
    first, second = make_cert("a"), make_cert("b")
    mount(secret, first[0], first[1])
    r = admission.CertReloader(str(secret / "tls.crt"), str(secret / "tls.key"), check_interval_s=3600)
    ctx = r.current()
    mount(secret, second[0], second[1])
    assert r.current() is ctx, "within the check interval the files are not even looked at"
    r.check_interval_s = 0
    assert r.current() is not ctx and r.reloads == 1


async def test_the_operator_serves_its_webhook_with_the_reloading_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the chart's env makes wiring.startup build: this server, with the check interval from the env."""
    import kopf
    import pdc_apiserver

    from tilert_operator import wiring

    cert, key, _ = make_cert("op")
    (tmp_path / "tls.crt").write_bytes(cert)
    (tmp_path / "tls.key").write_bytes(key)
    (tmp_path / "kubeconfig").write_text(pdc_apiserver.kubeconfig("http://127.0.0.1:1"))
    for k, v in {"KUBECONFIG": str(tmp_path / "kubeconfig"), "TILERT_PD_METRICS_PORT": "0", "TILERT_PD_WEBHOOK_PORT": "9443",
                 "TILERT_PD_WEBHOOK_CERT": str(tmp_path / "tls.crt"), "TILERT_PD_WEBHOOK_KEY": str(tmp_path / "tls.key"),
                 "TILERT_PD_WEBHOOK_CERT_CHECK_S": "5"}.items():  # fmt: skip
        monkeypatch.setenv(k, v)
    settings, memo = kopf.OperatorSettings(), kopf.Memo()
    await wiring.startup(settings=settings, memo=memo, logger=logging.getLogger("test"))
    try:
        server = settings.admission.server
        assert isinstance(server, admission.WebhookServer) and server.check_interval_s == 5.0
        assert server.port == 9443 and server.certfile == str(tmp_path / "tls.crt")
    finally:
        await memo.controller.stop()
        await memo.api.close()
