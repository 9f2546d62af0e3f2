"""What happened to one request: the record every request of a run leaves, whatever its outcome."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from bench.load.plan import Kind, Route

#: How a request ended, as a client sees it.
#: - ok: a 200 whose body (or stream, through `[DONE]`) was complete and carried no error;
#: - http_4xx / http_5xx: an error status before any byte of the answer (`error_type` is the OpenAI
#:   error's `type`);
#: - connect_error: no HTTP answer at all (refused, reset, closed before the headers);
#: - timeout: no complete answer within the plan's per-request limit;
#: - stream_error: the stream carried an error event (the router's way to fail after the first byte);
#: - stream_cut: the stream ended (or the connection broke) before `[DONE]`, with no error event;
#: - bad_response: a 200 that is not an OpenAI answer (not JSON, no choices);
#: - abandoned: the run stopped (its drain limit passed) before the answer was complete.
Outcome = Literal[
    "ok",
    "http_4xx",
    "http_5xx",
    "connect_error",
    "timeout",
    "stream_error",
    "stream_cut",
    "bad_response",
    "abandoned",
]
FAILURES: tuple[Outcome, ...] = (
    "http_4xx",
    "http_5xx",
    "connect_error",
    "timeout",
    "stream_error",
    "stream_cut",
    "bad_response",
    "abandoned",
)


@dataclass
class Record:
    seq: int
    kind: Kind
    stream: bool
    route_asked: Route
    greedy: bool
    prompt_index: int
    #: Seconds after the run's start: when it was due, when it was sent (later when the loop lagged).
    due: float
    start: float
    #: The phase (last mark at `start`) it belongs to.
    phase: str
    #: Sent as X-Request-Id (the router logs it and echoes it).
    request_id: str = ""
    end: float | None = None
    outcome: Outcome | None = None
    status: int | None = None
    #: The OpenAI error's `type` (HTTP errors and error events), else None.
    error_type: str | None = None
    #: The error in words (the server's message or the exception), shortened.
    error: str = ""
    #: The route the router says served it (its X-PD-Route header); None when the server does not say.
    route_served: str | None = None
    #: The router said it took more than one attempt (see client.ATTEMPTS_HEADER).
    retried: bool = False
    #: Streams: seconds from sending to the first chunk with text. Not set for whole answers.
    ttft: float | None = None
    #: Streams: mean seconds per output token after the first ((last - first chunk) / (tokens - 1)).
    tpot: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    text: str = ""
    #: Greedy requests with a reference: whether the text equals it. None = not compared.
    greedy_match: bool | None = None

    @property
    def latency(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    @property
    def failure(self) -> str | None:
        """The failure's class for counting: the outcome, with the error type when there is one
        (`http_5xx:upstream_error`); None when it succeeded or has not ended."""
        if self.outcome is None or self.outcome == "ok":
            return None
        return f"{self.outcome}:{self.error_type}" if self.error_type else self.outcome
