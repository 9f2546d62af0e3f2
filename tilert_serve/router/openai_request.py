"""Parse and check one OpenAI request body: pure functions, no I/O.

The router forwards the client's body to vLLM almost untouched, so this module does not model every
field; it checks the types of the fields the router itself acts on (model, stream, token limits,
sampling, stops) and lists the features the TileRT engine lacks, for the routing policy.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from tilert_serve.router.errors import RouterError, bad_request

Kind = Literal["chat", "completions"]

#: Integers the router reads (seed, token limits, token ids) are 64-bit, as vLLM's protocol types them.
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

# Fields whose non-default value needs an engine feature TileRT does not have: name -> default value
# (None = "any value at all needs the feature").
_TILERT_UNSUPPORTED: dict[str, Any] = {
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "repetition_penalty": 1,
    "logit_bias": None,
    "logprobs": None,
    "top_logprobs": None,
    "prompt_logprobs": None,
    "response_format": None,
    "guided_json": None,
    "guided_regex": None,
    "guided_choice": None,
    "guided_grammar": None,
    "structured_outputs": None,
    "tools": None,
    "tool_choice": None,
    "functions": None,
    "best_of": None,
    "echo": False,
    "suffix": None,
    "min_tokens": 0,
    "min_p": 0,
    "bad_words": None,
    "allowed_token_ids": None,
}


@dataclass(frozen=True)
class ParsedRequest:
    kind: Kind
    #: The client's body as parsed; never mutated (upstream bodies are copies).
    body: dict[str, Any]
    model: str
    stream: bool
    include_usage: bool
    #: Generated-token limit the client asked for (max_completion_tokens wins for chat); None = engine's.
    max_tokens: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    include_stop_str_in_output: bool
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    #: Why the TileRT path cannot serve this request (empty = it can).
    tilert_unsupported: tuple[str, ...] = field(default=())


def _needs(value: Any, default: Any) -> bool:
    """Whether a field's value asks for the feature (false, empty and the default do not)."""
    if value is None or value is False or value == [] or value == {}:
        return False
    if isinstance(value, dict) and value.get("type") == "text":
        return False  # response_format {"type": "text"} is plain generation
    if value == "none":
        return False  # tool_choice "none"
    return default is None or value != default


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, int | float)) and not isinstance(v, bool)


def _opt_int(
    body: dict[str, Any], name: str, minimum: int = _INT64_MIN, maximum: int = _INT64_MAX
) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v):
        raise bad_request(f"'{name}' must be an integer, got {type(v).__name__}", param=name)
    if v < minimum:
        raise bad_request(f"'{name}' must be >= {minimum}, got {v}", param=name)
    if v > maximum:
        raise bad_request(f"'{name}' must be <= {maximum}, got {_short(v)}", param=name)
    return int(v)


def _short(v: int) -> str:
    """An integer for a message: a 5000-digit one is not echoed whole."""
    text = str(v)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} digits)"


def _opt_number(
    body: dict[str, Any], name: str, lo: float, hi: float | None = None, *, lo_open: bool = False
) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_number(v):
        raise bad_request(f"'{name}' must be a number, got {type(v).__name__}", param=name)
    try:
        f = float(v)
    except OverflowError:
        f = math.inf
    if not math.isfinite(f) or f < lo or (lo_open and f == lo) or (hi is not None and f > hi):
        low = f"> {lo}" if lo_open else f">= {lo}"
        bounds = f"{low} and <= {hi}" if hi is not None else low
        shown = _short(v) if isinstance(v, int) else repr(v)
        raise bad_request(f"'{name}' must be a finite number {bounds}, got {shown}", param=name)
    return f


class _NonFinite(float):
    """NaN, Infinity or a float literal too large for a double, as the JSON parser met it; the check
    after parsing names the field that holds it."""

    text: str

    def __new__(cls, text: str) -> _NonFinite:
        obj = super().__new__(cls, "nan")
        obj.text = text
        return obj


def _parse_float(text: str) -> float:
    f = float(text)
    return f if math.isfinite(f) else _NonFinite(text)


def _find_non_finite(obj: Any, path: str) -> tuple[str, str] | None:
    """The path and literal of the first non-finite number in `obj`."""
    if isinstance(obj, _NonFinite):
        return path, obj.text
    if isinstance(obj, dict):
        for k, v in obj.items():
            found = _find_non_finite(v, f"{path}.{k}" if path else str(k))
            if found:
                return found
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            found = _find_non_finite(v, f"{path}[{i}]")
            if found:
                return found
    return None


def _loads(raw: bytes) -> Any:
    """JSON with every number finite: NaN, Infinity and overflowing literals (1e999) are refused with
    the field that holds them; nesting too deep for the parser is refused too."""
    seen: list[bool] = []

    def constant(text: str) -> float:
        seen.append(True)
        return _NonFinite(text)

    def number(text: str) -> float:
        f = _parse_float(text)
        if isinstance(f, _NonFinite):
            seen.append(True)
        return f

    try:
        body = json.loads(raw, parse_constant=constant, parse_float=number)
    except RecursionError:
        raise bad_request("request body is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from exc
    if seen:
        try:
            found = _find_non_finite(body, "")
        except RecursionError:
            found = None
        where, text = found or ("", "a non-finite number")
        field_name = where.split(".")[0].split("[")[0] or None
        raise bad_request(f"'{where or 'body'}' must be a finite number, got {text}", param=field_name)
    return body


#: vLLM's temperature floor (vllm/sampling_params.py): a positive temperature below it is raised to it,
#: since float logits divided by less overflow (5e-39 failed the decode on every TileRT node). The prefill
#: samples the first token so; the router tells the TileRT node the same.
_MIN_TEMPERATURE = 1e-2


def _vllm_temperature(t: float | None) -> float | None:
    return max(t, _MIN_TEMPERATURE) if t is not None and t > 0 else t


def _scalar(v: Any) -> bool:
    return isinstance(v, str | int | float)


def _check_vllm_xargs(body: dict[str, Any]) -> None:
    """`vllm_xargs` becomes the engine's extra_args on the prefill and the native decode: only the shape
    vLLM types it as (an object of strings, numbers and lists of them) goes upstream. A JSON string,
    which vLLM's speech endpoints parse but these refuse after the router had admitted and prefilled,
    is refused here, before any upstream work."""
    xargs = body.get("vllm_xargs")
    if xargs is None:
        return
    if not isinstance(xargs, dict):
        got = (
            "a string (send the object itself, not its JSON text)"
            if isinstance(xargs, str)
            else type(xargs).__name__
        )
        raise bad_request(
            f"'vllm_xargs' must be an object of strings, numbers or lists of them; got {got}",
            param="vllm_xargs",
        )
    for key, value in xargs.items():
        if not (_scalar(value) or (isinstance(value, list) and all(_scalar(v) for v in value))):
            shown = key if len(key) <= 64 else key[:64] + "..."
            raise bad_request(
                f"'vllm_xargs.{shown}' must be a string, a number or a list of them; got "
                f"{type(value).__name__}",
                param="vllm_xargs",
            )


def _opt_bool(body: dict[str, Any], name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad_request(f"'{name}' must be a boolean, got {type(v).__name__}", param=name)
    return v


def _check_prompt(body: dict[str, Any]) -> bool:
    """Check `prompt`; True when it holds more than one prompt (a batch)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return False
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return len(prompt) > 1
        if all(_is_int(p) for p in prompt):
            return False
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
            return len(prompt) > 1
    raise bad_request(
        "'prompt' must be a string, a list of strings, a list of token ids or a list of such lists",
        param="prompt",
    )


def _check_messages(body: dict[str, Any]) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of message objects", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"'messages[{i}]' must be an object with a string 'role'", param="messages")


def parse(kind: Kind, raw: bytes, served_models: list[str]) -> ParsedRequest:
    """Parse a request body; raise a 400 (404 for an unknown model) that names the field."""
    body = _loads(raw)
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, got {type(body).__name__}")

    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a string", param="model")
    if model not in served_models:
        raise RouterError(
            404,
            f"The model `{model}` does not exist. Served models: {', '.join(served_models)}.",
            type="NotFoundError",
            param="model",
            code="model_not_found",
        )

    batch = False
    if kind == "chat":
        _check_messages(body)
    else:
        batch = _check_prompt(body)

    stream = _opt_bool(body, "stream")
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise bad_request("'stream_options' must be an object", param="stream_options")
    include_usage = bool((stream_options or {}).get("include_usage", False))

    max_tokens = _opt_int(body, "max_tokens", 1)
    if kind == "chat":
        mct = _opt_int(body, "max_completion_tokens", 1)
        max_tokens = mct if mct is not None else max_tokens
    n = _opt_int(body, "n", 1)

    stop_raw = body.get("stop")
    if stop_raw is None:
        stop: tuple[str, ...] = ()
    elif isinstance(stop_raw, str):
        stop = (stop_raw,) if stop_raw else ()
    elif isinstance(stop_raw, list) and all(isinstance(s, str) for s in stop_raw):
        stop = tuple(s for s in stop_raw if s)
    else:
        raise bad_request("'stop' must be a string or a list of strings", param="stop")

    sti = body.get("stop_token_ids")
    if sti is not None and not (
        isinstance(sti, list) and all(_is_int(t) and 0 <= t <= _INT64_MAX for t in sti)
    ):
        raise bad_request(
            "'stop_token_ids' must be a list of token ids (integers from 0 to 2^63-1)", param="stop_token_ids"
        )

    temperature = _vllm_temperature(_opt_number(body, "temperature", 0.0, 2.0 if kind == "chat" else None))
    # vLLM's range: 0 < top_p <= 1 (a top_p of 0 would pass here and be refused after the prefill).
    top_p = _opt_number(body, "top_p", 0.0, 1.0, lo_open=True)
    top_k = _opt_int(body, "top_k", -1)
    seed = _opt_int(body, "seed")
    _check_vllm_xargs(body)

    # Only the keys the body has: most requests carry few of these fields.
    unsupported = sorted(
        k for k in body.keys() & _TILERT_UNSUPPORTED.keys() if _needs(body[k], _TILERT_UNSUPPORTED[k])
    )
    if n is not None and n > 1:
        unsupported.append("n")
    if batch:
        unsupported.append("prompt (batch)")

    return ParsedRequest(
        kind=kind,
        body=body,
        model=model,
        stream=stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
        stop=stop,
        stop_token_ids=tuple(sti or ()),
        ignore_eos=_opt_bool(body, "ignore_eos"),
        include_stop_str_in_output=_opt_bool(body, "include_stop_str_in_output"),
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        tilert_unsupported=tuple(unsupported),
    )
