"""`tilert-pd decode-node`: run a TileRT decode node (HTTP API + handoff control plane).

On SIGTERM the node drains (tilert_serve/draining.py): /ready answers 503 and /v1/admit refuses, while
tickets admitted before keep their handoff and their stream; once no slot is between admission and the
end of its stream (or --drain-timeout is up: each stream still running then ends with an SSE error event
of type shutting_down, each ticket not yet streaming fails with that reason) the node stops."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tilert_serve import dataplane, defaults, draining, layouts, tracing, tracing_otel, transfer
from tilert_serve.bearer import TokenFile, TokenFileError
from tilert_serve.decode import engines

if TYPE_CHECKING:  # the node and aiohttp load in run(), after the arguments are checked
    from aiohttp import web

    from tilert_serve.decode.node import DecodeNode


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model-dir", required=True, help="checkpoint directory (config.json, weights, tokenizer)"
    )
    p.add_argument(
        "--tilert-model",
        required=True,
        choices=["glm5", "deepseek_v3_2", "mla"],
        help="state layout family; mla = small DeepSeek-V3-style models",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="the prefill's vLLM KV-cache dtype (fp8_ds_mla, bfloat16, float32); auto = fp8_ds_mla for "
        "glm5/deepseek_v3_2, the checkpoint's dtype for mla",
    )
    p.add_argument(
        "--served-model-name",
        default="",
        help="the model name clients send, as the prefills' vLLM --served-model-name: part of the "
        "compatibility generation (tilert_serve/compat.py) a prefill must match",
    )
    p.add_argument(
        "--model-revision",
        default="",
        help="what identifies the weights (a checkpoint revision, a date): part of the compatibility "
        "generation; the prefills' kv_connector_extra_config model_revision must be the same",
    )
    p.add_argument("--engine", default="reference", choices=engines.ENGINES)
    p.add_argument("--slots", type=int, default=1, help="sequences decoded at once (tilert: 1)")
    p.add_argument("--max-seq-len", type=int, required=True, help="longest prompt + output, in tokens")
    p.add_argument("--host", default="0.0.0.0", help="address the HTTP API listens on")
    p.add_argument(
        "--advertise-host",
        default=os.environ.get("POD_IP") or None,
        help="the data-plane address when no --data-plane-networks are named: the control port listens "
        "there, senders and the router are told it (default: $POD_IP, else the hostname's)",
    )
    p.add_argument(
        "--data-plane-networks",
        default="",
        help="comma-separated Multus networks (spec.transfer.rdma.networks): the data-plane address is "
        "this pod's address on the first one, read from --network-status-file; no fallback",
    )
    p.add_argument(
        "--network-status-file",
        default=dataplane.NETWORK_STATUS_FILE,
        help="the pod's k8s.v1.cni.cncf.io/network-status annotation, mounted by the downward API",
    )
    p.add_argument(
        "--network-status-timeout",
        type=float,
        default=120.0,
        help="seconds to wait for Multus to report the data-plane network before giving up",
    )
    p.add_argument("--ctrl-port", type=int, default=defaults.DECODE_CTRL_PORT)
    p.add_argument("--http-port", type=int, default=defaults.DECODE_HTTP_PORT)
    p.add_argument("--transfer", default="mooncake", choices=transfer.ENGINES)
    p.add_argument("--protocol", default="tcp", choices=["tcp", "rdma"])
    p.add_argument(
        "--secret-file",
        default=defaults.SECRET_PATH,
        help="the handoff secret; an `accept` file beside it lists more accepted secrets, one per "
        "line; both are re-read when they change (rotation without a restart)",
    )
    p.add_argument(
        "--handoff-digest",
        default="on",
        choices=["on", "off"],
        help="check each handoff's digest of the bytes written before decoding it (off: take the "
        "state as it lands; only with prefills that send none)",
    )
    p.add_argument(
        "--quarantine-s",
        type=float,
        default=defaults.WRITE_QUARANTINE_S,
        help="seconds a slot released while a sender may still be writing stays out of use",
    )
    p.add_argument(
        "--api-token-file",
        default=None,
        help="bearer tokens (one a line, any accepted) that /v1/admit, /v1/generate, /v1/cancel and "
        f"/v1/status require; default {defaults.NODE_API_TOKEN_PATH} (the <cluster>-node-api "
        "Secret); '' = no authentication (logged). Absent flag and absent default file: "
        "no authentication, with a warning",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (engine and receive buffers)")
    p.add_argument("--shards", type=int, default=1, help="receive-buffer shards, one per GPU (cuda:0..N-1)")
    p.add_argument("--dtype", default="auto", help="engine dtype for the reference engine: float32, bfloat16")
    p.add_argument("--num-speculative-tokens", type=int, default=1, help="MTP draft tokens per step; 0 = off")
    p.add_argument(
        "--handoff-mtp-layers",
        type=int,
        choices=(0, 1),
        default=None,
        help="mla only: MTP layers the prefill hands over (1 when the prefill runs MTP, which registers "
        "the drafter's KV cache; 0 when it does not); default: as many as config.json has. Part of the "
        "handoff layout, so it must match the prefill's MTP setting whatever this node's own MTP is",
    )
    p.add_argument(
        "--ticket-ttl", type=float, default=defaults.TICKET_TTL_S, help="seconds a ticket holds a slot"
    )
    p.add_argument("--name", default=os.environ.get("POD_NAME") or socket.gethostname())
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds after SIGTERM for admitted requests and streams to finish before they are "
        "cancelled (default 30; pods get terminationGracePeriodSeconds - preStop sleep - 5)",
    )
    p.add_argument(
        "--http-idle-timeout",
        type=float,
        default=HTTP_IDLE_S,
        help="seconds an HTTP connection may stay open without a request in progress (idle keep-alive, "
        f"or request headers still arriving; default {HTTP_IDLE_S:g})",
    )
    p.add_argument("--log-level", default="INFO")
    p.add_argument(
        "--otlp-traces-endpoint",
        default="",
        help="the collector's OTLP/HTTP traces URL (http://collector:4318/v1/traces): spans of each "
        "traced request's admission and handoff stages go there; '' (default) = no tracing",
    )


def _layout(args: argparse.Namespace, hf_config: dict[str, Any] | None) -> layouts.Layout:
    if args.tilert_model == "mla":
        if hf_config is None:
            raise SystemExit(
                f"decode-node: {args.model_dir}/config.json is missing; the mla layout reads the "
                "layer count from it"
            )
        dtype = args.kv_cache_dtype if args.kv_cache_dtype != "auto" else _checkpoint_dtype(hf_config)
        layout = layouts.for_hf_config("mla", hf_config, dtype)
        if args.handoff_mtp_layers is None or args.handoff_mtp_layers == layout.num_mtp_layers:
            return layout
        mtp = args.handoff_mtp_layers
        return layouts.get("mla", dtype, num_layers=layout.num_main_layers + mtp, num_mtp_layers=mtp)
    dtype = "fp8_ds_mla" if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    return layouts.get(args.tilert_model, dtype)


def _checkpoint_dtype(hf_config: dict[str, Any]) -> str:
    return {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}.get(
        str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16"), "bfloat16"
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tilert_serve.decode.http import make_app
    from tilert_serve.decode.node import DecodeNode, NodeConfig
    from tilert_serve.handoff.auth import FileKeyring
    from tilert_serve.handoff.errors import AuthError

    model_dir = Path(args.model_dir)
    config_path = model_dir / "config.json"
    hf_config = json.loads(config_path.read_text()) if config_path.exists() else None
    try:
        layout = _layout(args, hf_config)
        secret = FileKeyring(args.secret_file)
        api_tokens = api_token_file(args.api_token_file)
        # Checked before the engine loads: a bad URL fails the start at once, naming the flag.
        tracer = tracing_otel.make_tracer(
            tracing.TracingConfig(args.otlp_traces_endpoint, service_name="tilert-decode")
        )
    except tracing.TracingConfigError as exc:
        raise SystemExit(f"decode-node: --otlp-traces-endpoint: {exc}") from exc
    except (ValueError, OSError, TokenFileError, AuthError) as exc:
        raise SystemExit(f"decode-node: {exc}") from exc
    where = find_data_plane(args)
    assert where.address is not None
    dtype = (
        args.dtype
        if args.dtype != "auto"
        else (_checkpoint_dtype(hf_config or {}) if args.device == "cpu" else "bfloat16")
    )
    engine = engines.create(
        engines.EngineSpec(
            name=args.engine,
            model_dir=str(model_dir),
            tilert_model=args.tilert_model,
            max_seq_len=args.max_seq_len,
            max_sequences=args.slots,
            device=args.device,
            dtype=dtype,
            num_speculative_tokens=args.num_speculative_tokens,
        )
    )
    devices = tuple([args.device] if args.shards == 1 else [f"cuda:{i}" for i in range(args.shards)])
    config = NodeConfig(
        name=args.name,
        max_seq_len=args.max_seq_len,
        slots=args.slots,
        host=args.host,
        advertise_host=where.address,
        ctrl_port=args.ctrl_port,
        http_port=args.http_port,
        shards=args.shards,
        devices=devices,
        ticket_ttl_s=args.ticket_ttl,
        quarantine_s=args.quarantine_s,
        verify_digest=args.handoff_digest == "on",
        model_name=args.served_model_name,
        model_revision=args.model_revision,
    )
    mover = transfer.create(
        args.transfer, host=where.address, protocol=args.protocol, role=args.name, interface=where.interface
    )
    tokenizer, eos = _tokenizer(model_dir)
    node = DecodeNode(
        config,
        layout=layout,
        engine=engine,
        transfer=mover,
        secret=secret,
        tokenizer=tokenizer,
        eos_token_ids=eos,
    )
    asyncio.run(
        serve(
            make_app(node, api_tokens, tracer),
            node,
            args.host,
            args.http_port,
            args.drain_timeout,
            args.http_idle_timeout,
        )
    )
    return 0


#: Seconds an HTTP connection may stay without a request in progress (idle keep-alive, or headers still
#: arriving): the router's default (its timeouts.client_idle_s). aiohttp's own is 3,630 s.
HTTP_IDLE_S = 15.0


def drain_for(node: DecodeNode, timeout_s: float) -> draining.Drain:
    """The node's drain: admissions refused, idle once no slot is active (tickets admitted before the
    SIGTERM keep their handoff and stream); at the deadline what is left ends with a clean error."""

    def deadline() -> None:
        node.end_all(
            f"the decode node is shutting down and its drain period ({timeout_s:g} s) ended before this "
            "request did; the tokens sent so far stand, send the rest to another node"
        )

    return draining.Drain(
        timeout_s,
        on_deadline=deadline,
        refuse=lambda r: r.method == "POST" and r.path == "/v1/admit",
        refuse_body={
            "error": {
                "type": "not_ready",
                "message": "the decode node is draining (shutting down); retry on another node",
            }
        },
    )


def node_idle(node: DecodeNode) -> bool:
    return node.idle


async def serve(
    app: web.Application,
    node: DecodeNode,
    host: str,
    port: int,
    drain_timeout: float,
    idle_s: float = HTTP_IDLE_S,
) -> str:
    """Serve `app` until SIGTERM/SIGINT, then drain and stop; returns the drain's outcome."""
    drain = drain_for(node, drain_timeout)
    app.middlewares.append(drain.middleware)
    runner = await start_http(app, host, port, idle_s)
    return await draining.serve_until_signal(
        runner, drain, stop_listening=False, idle=lambda: node_idle(node)
    )


async def start_http(
    app: web.Application, host: str, port: int, idle_s: float = HTTP_IDLE_S
) -> web.AppRunner:
    """The node's HTTP server, set up as the router's (tilert_serve/httpserver.py): idle and slow-header
    connections closed after `idle_s`, connections capped below the open-file limit, malformed requests
    answered in the node's JSON error shape."""
    from tilert_serve import httpserver
    from tilert_serve.decode.http import error_body

    return await httpserver.start(app, host, port, idle_s=idle_s, error_body=error_body)


def api_token_file(flag: str | None) -> TokenFile | None:
    """The node-API token file: the flag's path ('' = none, explicitly), else the mounted default when it
    exists. A named file that cannot be read stops the node (TokenFileError)."""
    if flag is None:
        if not Path(defaults.NODE_API_TOKEN_PATH).exists():
            return None  # make_app logs that the API is open
        flag = defaults.NODE_API_TOKEN_PATH
    return TokenFile(flag) if flag else None


def find_data_plane(args: argparse.Namespace, sleep: float = 1.0) -> dataplane.DataPlane:
    """This node's data-plane address (tilert_serve.dataplane): its Multus address when networks are
    named (waiting for Multus; exiting with the reason if it never reports), else the advertised one."""
    networks = [n.strip() for n in args.data_plane_networks.split(",") if n.strip()]
    fallback = "" if networks else args.advertise_host or socket.gethostbyname(socket.gethostname())
    try:
        return dataplane.find(
            networks,
            args.network_status_file,
            os.environ.get("POD_NAMESPACE", ""),
            fallback,
            args.network_status_timeout,
            sleep,
        )
    except dataplane.DataPlaneMissing as exc:
        raise SystemExit(f"decode-node: {exc}") from exc


def _tokenizer(model_dir: Path) -> tuple[object | None, frozenset[int]]:
    """The checkpoint's tokenizer (for text deltas) and its EOS ids (generation_config.json wins)."""
    eos: set[int] = set()
    gen_config = model_dir / "generation_config.json"
    if gen_config.exists():
        value = json.loads(gen_config.read_text()).get("eos_token_id")
        eos.update(value if isinstance(value, list) else [] if value is None else [value])
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError):
        logging.getLogger(__name__).warning(
            "no tokenizer in %s: streams carry token ids without text", model_dir
        )
        return None, frozenset(eos)
    if tok.eos_token_id is not None and not eos:
        eos.add(int(tok.eos_token_id))
    return tok, frozenset(eos)
