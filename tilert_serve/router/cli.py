"""`tilert-pd router --config FILE [--host H] [--port P]`: run the router until SIGTERM/SIGINT, then
drain: readiness turns false, the port closes, streams in flight finish for up to --drain-timeout
seconds, and what is left is cancelled (tilert_serve/draining.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging

from tilert_serve import defaults, draining
from tilert_serve.bearer import TokenFileError
from tilert_serve.router import config as config_mod
from tilert_serve.router.app import make_app, start
from tilert_serve.tracing import TracingConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", required=True, help="router config.yaml (the ConfigMap's file); reloaded on change"
    )
    parser.add_argument("--host", default="0.0.0.0", help="listen address (default 0.0.0.0)")
    parser.add_argument(
        "--port", type=int, default=defaults.ROUTER_PORT, help=f"listen port (default {defaults.ROUTER_PORT})"
    )
    parser.add_argument(
        "--reuse-port",
        action="store_true",
        help="share --port with other router replicas on this host (SO_REUSEPORT, same user only): the "
        "kernel spreads connections over the live ones, as a Service does over pods (local runs)",
    )
    parser.add_argument(
        "--replica-port",
        type=int,
        default=None,
        help="also listen on this port, not shared: probes and scrapes reach this replica alone",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    parser.add_argument("--no-health-checks", action="store_true", help="do not probe upstreams")
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds after SIGTERM for streams in flight to finish before they are cancelled "
        "(default 30; pods get terminationGracePeriodSeconds - preStop sleep - 5)",
    )


async def _main(args: argparse.Namespace) -> int:
    cfg = config_mod.load(args.config)
    try:
        app = make_app(cfg, config_path=args.config, health_checks=not args.no_health_checks)
    except (TokenFileError, TracingConfigError) as exc:
        raise SystemExit(f"router: {exc}") from exc
    drain = draining.Drain(args.drain_timeout)
    app.middlewares.append(drain.middleware)
    runner = await start(
        app, args.host, args.port, reuse_port=args.reuse_port, replica_port=args.replica_port
    )
    logging.getLogger(__name__).info(
        "router listening on %s:%d%s (model %s)",
        args.host,
        args.port,
        f" (shared) and {args.replica_port}" if args.reuse_port and args.replica_port else "",
        cfg.model,
    )
    await draining.serve_until_signal(runner, drain, stop_listening=True)
    return 0


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        import uvloop  # the faster event loop when installed; the router works without it
    except ImportError:
        return asyncio.run(_main(args))
    return uvloop.run(_main(args))


if __name__ == "__main__":
    import sys

    p = argparse.ArgumentParser(prog="tilert-pd router")
    add_arguments(p)
    sys.exit(run(p.parse_args()))
