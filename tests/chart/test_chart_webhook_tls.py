"""The chart's webhook wiring against kopf's real webhook server, over TLS on loopback.

The chart renders a ValidatingWebhookConfiguration (Service DNS name, path, caBundle) and a Deployment
whose env points the operator at the mounted kubernetes.io/tls Secret. Here a certificate is made for
that DNS name, kopf's WebhookServer is built from the rendered env exactly as
operator/tilert_operator/wiring.py builds it, and an HTTPS client that trusts only the rendered caBundle and
checks the rendered host name posts an AdmissionReview to the rendered path. What a real API server
adds (Service routing, its own TLS client) is not covered.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import ssl
import subprocess
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml

from tilert_serve.local.runner import free_port


async def test_webhook_serves_the_mounted_secret_to_the_rendered_client_config(
    chart: Any, tmp_path: Path
) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is needed to make a test certificate")
    port, namespace = free_port(), "ops"
    host = f"tpd-tilert-pd-webhook.{namespace}.svc"
    # A self-signed certificate is its own CA: what `webhook.tls.caBundle` carries in that setup.
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={host}",
         "-addext", f"subjectAltName=DNS:{host}", "-keyout", str(tmp_path / "tls.key"), "-out", str(tmp_path / "tls.crt")],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    ca = base64.b64encode((tmp_path / "tls.crt").read_bytes()).decode()
    values = {"webhook": {"enabled": True, "port": port, "tls": {"caBundle": ca}}}
    out = chart.render(values, name="tpd", namespace=namespace, is_install=True)
    objs = [
        o
        for path, text in out.items()
        if not path.endswith("NOTES.txt")
        for o in yaml.safe_load_all(text)
        if o
    ]
    (dep,) = [o for o in objs if o["kind"] == "Deployment"]
    (vwc,) = [o for o in objs if o["kind"] == "ValidatingWebhookConfiguration"]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "webhook-tls"]
    # The Secret's files appear under the mount path in the pod; here they are in tmp_path.
    env = {e["name"]: e["value"].replace(mount["mountPath"], str(tmp_path)) for e in container["env"]}
    (hook,) = vwc["webhooks"]
    client = hook["clientConfig"]
    assert f"{client['service']['name']}.{client['service']['namespace']}.svc" == host

    # As operator/tilert_operator/wiring.py: WebhookServer(port=..., certfile=..., pkeyfile=...).
    server = kopf.WebhookServer(
        port=int(env["TILERT_PD_WEBHOOK_PORT"]),
        certfile=env["TILERT_PD_WEBHOOK_CERT"],
        pkeyfile=env["TILERT_PD_WEBHOOK_KEY"],
    )
    seen: list[str | None] = []

    async def fn(request: Any, *, webhook: str | None = None, **_: Any) -> Any:
        seen.append(webhook)
        return {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "response": {"uid": request["request"]["uid"], "allowed": True},
        }

    ctx = ssl.create_default_context(cadata=base64.b64decode(client["caBundle"]).decode())
    review = json.dumps(
        {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": "u1"}}
    ).encode()
    serving = server(fn)
    try:
        await asyncio.wait_for(anext(serving), 30)
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname=host), 30
        )
        writer.write(
            f"POST {client['service']['path']} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(review)}\r\nConnection: close\r\n\r\n".encode()
            + review
        )
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 30)
        writer.close()
    finally:
        await serving.aclose()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert json.loads(body)["response"] == {"uid": "u1", "allowed": True}
    # kopf routes /<id> to the handler with that id: the rendered path reaches "validate-pdcluster".
    assert seen == ["validate-pdcluster"]
