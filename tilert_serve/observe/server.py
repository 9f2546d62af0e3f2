"""A local Prometheus for a local stack: `start` writes its configuration under a state directory,
starts Debian's `prometheus` on 127.0.0.1 with basic auth, and returns once it answers; `stop` ends
it. The returned `Prometheus` is the handle and its caller the one owner: a handle is stopped once.

    handle = start(state_dir, [Target("router", "127.0.0.1:8000", token_file=keys),
                               Target("tilert-decode", "127.0.0.1:5557")])
    print(handle.url)          # basic auth: handle.username / handle.password_file
    stop(handle)

Files under `state_dir/prometheus/`: prometheus.yml, web.yml (the password's bcrypt hash), password
(0600), tokens/<job> (the first token of each target's token file, 0600), data/ (the TSDB), and
prometheus.log. A second `start` on the same directory reuses the data and makes a new password.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from base64 import b64encode
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from tilert_serve.bearer import TokenFileError, parse_tokens, read_regular
from tilert_serve.observe import config as cfg
from tilert_serve.observe import paths

log = logging.getLogger(__name__)

USERNAME = "tilert-pd"


class ObserveError(RuntimeError):
    """Prometheus could not be set up or started; the message says what to do."""


@dataclass
class Prometheus:
    """A running local Prometheus."""

    url: str
    username: str
    password_file: Path
    directory: Path
    config_file: Path
    log_file: Path
    process: subprocess.Popen[bytes]

    def authorization(self) -> str:
        """The `Authorization` header value for its API."""
        password = self.password_file.read_text()
        return "Basic " + b64encode(f"{self.username}:{password}".encode()).decode()


def binary() -> str:
    """The prometheus executable, or an error saying how to install it."""
    found = shutil.which("prometheus") or (
        "/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None
    )
    if found is None:
        raise ObserveError(
            "prometheus is not installed: `make setup` installs Debian's package "
            "(or: apt-get install --no-install-recommends prometheus)"
        )
    return found


def bcrypt_hash(password: str) -> str:
    """The bcrypt hash Prometheus' web config wants. The `bcrypt` package when installed, else the C
    library's crypt(3), which on Debian (libxcrypt) makes bcrypt hashes too."""
    try:
        import bcrypt  # type: ignore[import-not-found,unused-ignore]

        return str(bcrypt.hashpw(password.encode(), bcrypt.gensalt()).decode())
    except ImportError:
        pass
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # crypt leaves the standard library in 3.13
        try:
            import crypt
        except ImportError:
            raise ObserveError("no bcrypt implementation: pip install bcrypt") from None
        hashed = crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH))
    if not hashed or not hashed.startswith("$2"):
        raise ObserveError("this C library's crypt(3) makes no bcrypt hashes: pip install bcrypt")
    return hashed


def _private(path: Path, text: str) -> None:
    """Write `text` to `path`, readable by its owner only from the first byte on."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _first_token(path: Path) -> str:
    try:
        tokens = parse_tokens(read_regular(path).decode())
    except (OSError, TokenFileError, UnicodeDecodeError) as e:
        raise ObserveError(f"token file {path}: {e}; give a readable file with one token a line") from None
    if not tokens:
        raise ObserveError(f"token file {path} holds no token; put the scrape's API key on its first line")
    return tokens[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def start(
    state_dir: Path,
    targets: Sequence[cfg.Target],
    *,
    rules: Sequence[Path] | None = None,
    intervals: cfg.Intervals = cfg.DEFAULT_INTERVALS,
    port: int = 0,
    cluster: str = cfg.LOCAL_CLUSTER,
    timeout_s: float = 60.0,
) -> Prometheus:
    """Start a Prometheus scraping `targets` and evaluating `rules` (default: the chart's rule file)
    on 127.0.0.1:`port` (0: a free one); return once it is ready, or raise with its log's tail."""
    exe = binary()
    rule_files = [Path(p).resolve() for p in (rules if rules is not None else [paths.rules_file()])]
    for p in rule_files:
        if not p.is_file():
            raise ObserveError(f"rule file {p} does not exist")
    directory = Path(state_dir).resolve() / "prometheus"
    (directory / "tokens").mkdir(parents=True, exist_ok=True)
    (directory / "data").mkdir(exist_ok=True)
    os.chmod(directory, 0o700)

    token_files: dict[str, Path] = {}
    for t in targets:
        if t.token_file is not None and t.job not in token_files:
            token_files[t.job] = directory / "tokens" / t.job
            _private(token_files[t.job], _first_token(t.token_file))
    config_file = directory / "prometheus.yml"
    config_file.write_text(
        yaml.safe_dump(cfg.render(targets, token_files, rule_files, intervals, cluster), sort_keys=False)
    )
    password = secrets.token_urlsafe(24)
    password_file = directory / "password"
    _private(password_file, password)
    web_file = directory / "web.yml"
    web_file.write_text(yaml.safe_dump(cfg.web_config(USERNAME, bcrypt_hash(password))))

    port = port or _free_port()
    log_file = directory / "prometheus.log"
    command = [
        exe,
        f"--config.file={config_file}",
        f"--web.config.file={web_file}",
        f"--web.listen-address=127.0.0.1:{port}",
        f"--storage.tsdb.path={directory / 'data'}",
        "--storage.tsdb.retention.time=2d",
    ]
    log.info(
        "prometheus: starting on 127.0.0.1:%d (%d targets, %d rule files)",
        port,
        len(targets),
        len(rule_files),
    )
    with open(log_file, "ab") as out:
        # Its own session: it outlives the command that started it (`tilert-pd local up` returns while
        # the stack runs), and `local down` stops its process group as it stops the components'.
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    handle = Prometheus(
        url=f"http://127.0.0.1:{port}",
        username=USERNAME,
        password_file=password_file,
        directory=directory,
        config_file=config_file,
        log_file=log_file,
        process=process,
    )
    try:
        _wait_ready(handle, timeout_s)
    except BaseException:
        stop(handle)
        raise
    log.info("prometheus: ready at %s (user %s, password in %s)", handle.url, USERNAME, password_file)
    return handle


def _wait_ready(handle: Prometheus, timeout_s: float) -> None:
    request = urllib.request.Request(
        f"{handle.url}/-/ready", headers={"Authorization": handle.authorization()}
    )
    deadline = time.monotonic() + timeout_s
    while True:
        if handle.process.poll() is not None:
            raise ObserveError(
                f"prometheus exited with status {handle.process.returncode}; its log "
                f"({handle.log_file}) ends:\n{_tail(handle.log_file)}"
            )
        try:
            with urllib.request.urlopen(request, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise ObserveError(
                f"prometheus did not become ready within {timeout_s:g} s; its log ({handle.log_file}) "
                f"ends:\n{_tail(handle.log_file)}"
            )
        time.sleep(0.1)


def stop(handle: Prometheus, timeout_s: float = 20.0) -> None:
    """End the Prometheus (SIGTERM, then SIGKILL after `timeout_s`); its files stay."""
    if handle.process.poll() is not None:
        return
    handle.process.terminate()
    try:
        handle.process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        log.warning("prometheus: did not stop within %g s of SIGTERM; killing it", timeout_s)
        handle.process.kill()
        handle.process.wait()
