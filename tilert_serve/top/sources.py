"""Where `top` reads metrics from, and one scrape (the I/O edge).

A local stack's sources come from what `tilert-pd local up` recorded in its state directory (the
router's URL, each TileRT node's URL and the node API token file, read with the local runner's own
`load`); a cluster's are given as URLs (through `kubectl port-forward`). A scrape never raises: a
source that does not answer becomes a `Scrape` with the error, and the screen shows it as down."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from tilert_operator import constants
from tilert_serve.bearer import TokenFile, TokenFileError
from tilert_serve.local import runner
from tilert_serve.local.cli import private_dir
from tilert_serve.top import samples
from tilert_serve.top.view import Scrape, Source

#: The largest metrics page read; a node's or router's is tens of kB.
MAX_BYTES = 8 << 20

# No proxy from the environment: the sources are local or port-forwarded, and a bearer token must not
# travel through a proxy nobody named.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass(frozen=True)
class Target:
    """A source and the bearer credential sent to it (None: none)."""

    source: Source
    token: TokenFile | None = None


def check_url(url: str, flag: str) -> str:
    """`url` without a trailing slash; ValueError naming `flag` when it is not an http(s) URL with a host."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(
            f"{flag} {url!r} is not an http(s) URL with a host; give it as http://HOST:PORT "
            "(for a cluster, the local end of `kubectl port-forward`)"
        )
    return url.rstrip("/")


def token_file(path: Path | None, flag: str) -> TokenFile | None:
    """The token file at `path`, checked now so that a wrong path fails at start; ValueError naming `flag`."""
    if path is None:
        return None
    try:
        return TokenFile(path)
    except TokenFileError as exc:
        raise ValueError(f"{flag}: {exc}") from exc


def explicit(
    router: str, nodes: Sequence[str], node_token: Path | None = None, api_key: Path | None = None
) -> list[Target]:
    """A router (with its client API key, when it has keys) and TileRT nodes given by URL."""
    named = [node_name(n) for n in nodes]
    node_tokens = token_file(node_token, "--token-file")
    return [
        Target(
            Source("router", "router", check_url(router, "--router")), token_file(api_key, "--api-key-file")
        ),
        *(Target(Source(name, "node", u), node_tokens) for name, u in named),
    ]


def node_name(value: str) -> tuple[str, str]:
    """`--node [NAME=]URL` -> (name, URL); the name defaults to the URL's host:port. Naming a node as
    the router's config does (tilert[].name) lines it up with the slots the router holds on it."""
    name, sep, url = value.partition("=")
    if not sep or "://" in name:
        url = check_url(value, "--node")
        return urlsplit(url).netloc, url
    if not name:
        raise ValueError(f"--node {value!r} has an empty name; give NAME=URL or just URL")
    return name, check_url(url, "--node")


def local_stack(home: Path, name: str | None, api_key: Path | None = None) -> list[Target]:
    """The router and TileRT nodes of the local stack `name` under `home` (the only one when `name` is
    None), as `tilert-pd local up` recorded them."""
    # The state names where the node token is sent: refuse a directory another user could change, as
    # `tilert-pd local` does.
    if home.exists():
        private_dir(home, create=False)
    stacks = sorted(p.parent for p in home.glob(f"*/{runner.STATE_FILE}"))
    if name is not None:
        stacks = [s for s in stacks if s.name == name]
    if not stacks:
        which = f"named {name!r} " if name is not None else ""
        raise ValueError(
            f"no local stack {which}is recorded under {home}; start one with `tilert-pd local up -f FILE`, "
            "pass the --home it used, or give --router URL for a cluster"
        )
    if len(stacks) > 1:
        raise ValueError(
            f"{len(stacks)} local stacks are recorded under {home} "
            f"({', '.join(s.name for s in stacks)}); pick one with --name"
        )
    state_dir = private_dir(stacks[0], create=False)
    try:
        meta, procs = runner.load(state_dir)
    except (KeyError, TypeError) as exc:
        raise ValueError(
            f"{state_dir / runner.STATE_FILE} is not a process-runtime stack's state (a docker runtime "
            f"stack records pods, {exc} is missing); give its URLs: --router URL --node URL ..."
        ) from exc
    token = state_dir / runner.NODE_API_TOKEN_FILE
    node_token = token_file(token, "the stack's node API token") if token.exists() else None
    return [
        Target(Source("router", "router", str(meta["router"])), token_file(api_key, "--api-key-file")),
        *(
            Target(Source(p.name, "node", p.url.rstrip("/")), node_token)
            for p in procs
            if p.kind == constants.TILERT
        ),
    ]


def _reason(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        hint = " (give a key with --api-key-file)" if exc.code in (401, 403) else ""
        return f"HTTP {exc.code} {exc.reason}{hint}"
    if isinstance(exc, urllib.error.URLError):
        return str(exc.reason)
    return str(exc) or type(exc).__name__


def scrape(target: Target, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> Scrape:
    """GET the source's /metrics and parse it; a failure becomes the scrape's error, never an exception."""
    t0 = clock()
    headers = {"Accept": "text/plain"}
    try:
        bearer = target.token.first() if target.token is not None else None
        if bearer is not None:
            headers["Authorization"] = f"Bearer {bearer}"
        req = urllib.request.Request(target.source.url + "/metrics", headers=headers)
        with _OPENER.open(req, timeout=timeout_s) as resp:
            body = resp.read(MAX_BYTES + 1)
        if len(body) > MAX_BYTES:
            raise ValueError(f"its metrics page is over {MAX_BYTES} bytes; is this a component's URL?")
        parsed = samples.parse(body.decode("utf-8", "replace"))
    except (OSError, ValueError) as exc:
        t = clock()
        return Scrape(target.source, t, None, _reason(exc), t - t0)
    t = clock()
    return Scrape(target.source, t, parsed, None, t - t0)


class Scraper:
    """Scrapes every target at once, each on a thread of its own pool; the caller owns it and closes
    it (a `with` block)."""

    def __init__(self, targets: Sequence[Target], timeout_s: float) -> None:
        self.targets = list(targets)
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, len(self.targets)), thread_name_prefix="top-scrape"
        )

    def round(self) -> list[Scrape]:
        return list(self._pool.map(lambda t: scrape(t, self.timeout_s), self.targets))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> Scraper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
