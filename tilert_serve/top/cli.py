"""`tilert-pd top`: watch a running stack in a terminal, refreshed every second.

    tilert-pd top                                   # the local stack under ./.tilert-pd
    tilert-pd top --home DIR --name NAME            # one of several local stacks
    tilert-pd top --router http://127.0.0.1:8000 --node t0=http://127.0.0.1:5557   # port-forwarded
    tilert-pd top --once                            # one screen on stdout, then exit

The screen is drawn with rich's `Live` (in the venv through vLLM's CLI dependencies): it redraws in
place without flicker, uses the terminal's alternate screen and gives it back on exit, follows
resizes and works in any terminal an SSH session has, with no curses code of ours. `--once` and a
stdout that is not a terminal print plain lines. Ctrl-C (or SIGTERM, SIGHUP) ends it with exit code 0.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from tilert_serve.local.cli import DEFAULT_HOME
from tilert_serve.top import screen, sources, view
from tilert_serve.top.sources import Scraper, Target

DEFAULT_INTERVAL_S = 1.0
DEFAULT_TIMEOUT_S = 2.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    local = p.add_argument_group("a local stack (the default: `tilert-pd local up`'s state)")
    local.add_argument(
        "--home",
        type=Path,
        default=None,
        help="the state directory `tilert-pd local` used (default ./.tilert-pd)",
    )
    local.add_argument("--name", help="which stack under --home, when it holds several")
    remote = p.add_argument_group("a cluster (through `kubectl port-forward`)")
    remote.add_argument("--router", metavar="URL", help="the router's URL, e.g. http://127.0.0.1:8000")
    remote.add_argument(
        "--node",
        metavar="[NAME=]URL",
        action="append",
        default=[],
        help="a TileRT node's HTTP URL, repeated for each; NAME (the router config's tilert[].name) "
        "defaults to the URL's host:port",
    )
    remote.add_argument(
        "--token-file",
        type=Path,
        help="the node API token file, sent to the nodes as a bearer token (their /metrics is open today)",
    )
    p.add_argument(
        "--api-key-file",
        type=Path,
        help="a file whose first line is a router API key: its /metrics wants one when the router has "
        "API keys and metrics_public is false",
    )
    p.add_argument(
        "--interval",
        type=float,
        default=DEFAULT_INTERVAL_S,
        help="seconds between screens (default %(default)s)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="seconds a source may take to answer before it shows as down (default %(default)s)",
    )
    p.add_argument("--once", action="store_true", help="print one screen (rates over one interval) and exit")


def targets(args: argparse.Namespace) -> list[Target]:
    """The sources the arguments name; ValueError saying what is wrong and how to fix it."""
    if args.interval <= 0 or args.timeout <= 0:
        raise ValueError("--interval and --timeout are seconds, above 0")
    if args.router is not None:
        if args.home is not None or args.name is not None:
            raise ValueError("give either --router (a cluster) or --home/--name (a local stack), not both")
        return sources.explicit(args.router, args.node, args.token_file, args.api_key_file)
    if args.node or args.token_file is not None:
        raise ValueError("--node and --token-file go with --router URL")
    home = DEFAULT_HOME if args.home is None else args.home
    return sources.local_stack(home, args.name, args.api_key_file)


def _clock() -> str:
    return datetime.now(UTC).strftime("%H:%M:%S UTC")


def once(scraper: Scraper, interval_s: float) -> list[str]:
    """One screen: two rounds `interval_s` apart, so that the rates are over that interval."""
    first = scraper.round()
    time.sleep(interval_s)
    return screen.lines(view.build(scraper.round(), first), _clock())


def watch(scraper: Scraper, interval_s: float) -> None:
    """Redraw every `interval_s` until interrupted (KeyboardInterrupt propagates to `run`)."""
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    console = Console()

    def render(lines: list[str]) -> Text:
        return Text("\n".join([*lines, "", "Ctrl-C quits"]), no_wrap=True, overflow="crop")

    previous: list[view.Scrape] | None = None
    with Live(console=console, screen=console.is_terminal, auto_refresh=False, transient=False) as live:
        while True:
            started = time.monotonic()
            current = scraper.round()
            live.update(render(screen.lines(view.build(current, previous), _clock())), refresh=True)
            previous = current
            time.sleep(max(0.0, interval_s - (time.monotonic() - started)))


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    try:
        chosen = targets(args)
    except ValueError as exc:
        print(f"tilert-pd top: {exc}", file=sys.stderr)
        return 2
    # SIGTERM (kill) and SIGHUP (the SSH session went away) end it as Ctrl-C does, so that the terminal
    # gets its screen back; the previous handlers come back after.
    before = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        with Scraper(chosen, args.timeout) as scraper:
            if args.once:
                print("\n".join(once(scraper, args.interval)))
            else:
                watch(scraper, args.interval)
    except KeyboardInterrupt:
        pass
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    return 0
