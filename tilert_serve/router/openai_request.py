"""Parse and check one OpenAI request body: pure functions, no I/O.

The router forwards the client's body to vLLM almost untouched, so this module does not model every
field; it checks the types of the fields the router itself acts on (model, stream, token limits,
sampling, stops) and lists the features the TileRT engine lacks, for the routing policy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from tilert_serve.router.errors import RouterError, bad_request

Kind = Literal["chat", "completions"]

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


def _opt_int(body: dict[str, Any], name: str, minimum: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v):
        raise bad_request(f"'{name}' must be an integer, got {type(v).__name__}", param=name)
    if minimum is not None and v < minimum:
        raise bad_request(f"'{name}' must be >= {minimum}, got {v}", param=name)
    return int(v)


def _opt_number(body: dict[str, Any], name: str, lo: float, hi: float | None = None) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_number(v):
        raise bad_request(f"'{name}' must be a number, got {type(v).__name__}", param=name)
    if v < lo or (hi is not None and v > hi):
        bounds = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise bad_request(f"'{name}' must be {bounds}, got {v}", param=name)
    return float(v)


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
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from exc
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
    if sti is not None and not (isinstance(sti, list) and all(_is_int(t) for t in sti)):
        raise bad_request("'stop_token_ids' must be a list of integers", param="stop_token_ids")

    temperature = _opt_number(body, "temperature", 0.0, 2.0 if kind == "chat" else None)
    top_p = _opt_number(body, "top_p", 0.0, 1.0)
    top_k = _opt_int(body, "top_k", -1)
    seed = _opt_int(body, "seed")

    # Only the keys the body has: most requests carry few of these fields.
    unsupported = sorted(k for k in body.keys() & _TILERT_UNSUPPORTED.keys() if _needs(body[k], _TILERT_UNSUPPORTED[k]))
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
