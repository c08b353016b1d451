"""The OpenAI API's request and response shapes, and its error bodies, as the server speaks them.

Owns parsing and validating a request body into engine prompts and ``SamplingParams``, and
building the JSON of responses and streamed chunks. It never calls the engine: whatever the
engine itself refuses (token ids out of range, a prompt too long) comes back through
``engine_loop`` as an error event and is turned into a body here.

Known fields are strict: a wrong type is an error (``"max_tokens": "5"`` is not 5, ``true`` is
not 1). An unknown field is ignored and logged once (vLLM does the same, and clients such as
guidellm and aiperf send fields of their own); a field minipaged does not implement and that
would change the answer (suffix, bad_words, ...) is refused when it is set. ``response_format``,
``structured_outputs`` and vLLM's ``guided_*`` fields constrain the text (structured outputs);
``tools`` are taken with ``tool_choice: "none"`` only (there is no tool parser).
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..sampling import SamplingParams

log = logging.getLogger("minipaged.server")


# -- errors --------------------------------------------------------------------------------
class APIError(Exception):
    """An error with an HTTP status and an OpenAI-style body: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def untrusted_chat_template() -> APIError:
    """vLLM's refusal of a request's own chat template when the server was not told to trust them."""
    return APIError(
        400, "Chat template is passed with request, but --trust-request-chat-template is not set. Refused request with "
        "untrusted chat template (start the server with --trust-request-chat-template to allow them)",
        "invalid_request_error", "chat_template", "untrusted_chat_template",
    )


def model_not_found(name: str, served: list[str]) -> APIError:
    return APIError(
        404, f"the model {name!r} does not exist here; this server serves {served} (see GET /v1/models)",
        "not_found_error", "model", "model_not_found",
    )


def overloaded(num_waiting: int, limit: int) -> APIError:
    return APIError(
        503, f"the server is overloaded: {num_waiting} requests are already waiting (limit {limit}); retry later, "
        "or start the server with a larger --max-waiting-requests",
        "server_overloaded", None, "server_overloaded",
    )


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down and takes no new requests", "server_shutting_down", None, "shutting_down")


def internal_error(message: str) -> APIError:
    return APIError(500, message, "internal_error", None, "internal_error")


# -- requests ------------------------------------------------------------------------------
# Fields minipaged does not implement, and the values that mean "not used". Set to anything
# else they are refused (400, code "unsupported_parameter"): ignoring them would change the
# answer without saying so (a tool call or a JSON schema that is never honoured).
UNSUPPORTED: dict[str, tuple] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "bad_words": (None, []),
    "logits_processors": (None, []),
    "truncate_prompt_tokens": (None,),
    "use_beam_search": (None, False),
    "prompt_embeds": (None,),
}
# Any other field a request's schema does not know is ignored and logged once per name, as
# vLLM does (clients send ``store``, ``metadata``, ``parallel_tool_calls``, ``service_tier``...).
_LOGGED_UNKNOWN: set[str] = set()
MAX_LOGPROBS = 20


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)  # OpenAI's newer name for max_tokens
    temperature: Optional[float] = Field(default=None, ge=0, le=2)  # OpenAI's range
    top_p: Optional[float] = Field(default=None, gt=0, le=1)
    top_k: Optional[int] = Field(default=None, ge=-1)  # vLLM's extension: 0 or -1 keeps every token
    min_p: Optional[float] = Field(default=None, ge=0, le=1)  # vLLM's extension
    seed: Optional[int] = None  # its range is SamplingParams' to check
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None  # vLLM's extension
    ignore_eos: bool = False  # vLLM's extension; load generators set it
    n: int = Field(default=1, ge=1, le=64)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    presence_penalty: Optional[float] = Field(default=None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2, le=2)
    repetition_penalty: Optional[float] = Field(default=None, gt=0)  # vLLM's extension
    min_tokens: Optional[int] = Field(default=None, ge=0)  # vLLM's extension
    logit_bias: Optional[dict[str, float]] = None  # token id (as a string, OpenAI's form) -> bias
    allowed_token_ids: Optional[list[int]] = None  # vLLM's extension
    include_stop_str_in_output: bool = False  # vLLM's extension
    skip_special_tokens: bool = True  # vLLM's extension
    spaces_between_special_tokens: bool = True  # vLLM's extension
    prompt_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)  # vLLM's extension
    return_tokens_as_token_ids: Optional[bool] = None  # vLLM's extension: logprobs name tokens "token_id:<id>"
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs object and its older guided_* fields
    response_format: Optional[dict[str, Any]] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 16:
            raise ValueError(f"at most 16 stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return v


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]
    name: Optional[str] = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class CompletionRequest(_Common):
    # a string, a list of token ids, or a batch of either (one choice per prompt)
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)  # top tokens per generated token
    echo: bool = False  # the answer starts with the prompt


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True  # vLLM's extension: open the assistant's turn
    continue_final_message: bool = False  # vLLM's extension: the last (assistant) message goes on
    # vLLM's extensions: a Jinja template in place of the model's (only when the server trusts
    # request templates: --trust-request-chat-template), and more variables for the template
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None

    def request_template(self) -> str | None:
        """The template this request brings: ``chat_template``, or one inside ``chat_template_kwargs`` (vLLM takes both)."""
        if self.chat_template is not None:
            return self.chat_template
        t = (self.chat_template_kwargs or {}).get("chat_template")
        return t if t is not None else None


_UNION_TAGS = {"str", "int", "float", "bool", "list[int]", "list[str]", "list[list[int]]", "list[TextPart]"}
_SHAPES = {
    "prompt": "a string, a list of token ids, or a list of strings or of token-id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of {\"type\": \"text\", \"text\": ...} parts",
}


def _describe(e: dict) -> tuple[str, str | None]:
    """One pydantic error -> ("field.path: what is wrong (got ...)", top-level field)."""
    loc = [str(x) for x in e.get("loc", ()) if str(x) not in _UNION_TAGS]
    path = ".".join(loc)
    shown = json.dumps(e.get("input"), default=str)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    field = next((name for name in reversed(loc) if name in _SHAPES), None)
    what = f"must be {_SHAPES[field]}" if field and e.get("type") in ("string_type", "list_type", "int_type", "model_type", "model_attributes_type") else e.get("msg", "invalid")
    return f"{path}: {what} (got {shown})", (loc[0] if loc else None)


def parse_request(kind: Literal["completion", "chat"], data: Any):
    """A decoded JSON body -> a validated request model, or an APIError(400) that says what to fix.

    Unknown fields are ignored (and logged once per name), as vLLM ignores them; a field in
    ``UNSUPPORTED`` set to a value that matters is refused."""
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(data).__name__}")
    cls = CompletionRequest if kind == "completion" else ChatCompletionRequest
    if kind == "completion" and "messages" in data and "prompt" not in data:
        raise bad_request("messages: this is a chat request; send it to /v1/chat/completions (or give a prompt)", "messages")
    if kind == "chat" and "prompt" in data and "messages" not in data:
        raise bad_request("prompt: this is a completion request; send it to /v1/completions (or give messages)", "prompt")
    known = set(cls.model_fields)
    data = dict(data)
    check_tools(data)
    body = {}
    for key, value in data.items():
        if key in UNSUPPORTED:
            if not any(value == ok and type(value) is type(ok) or value is ok for ok in UNSUPPORTED[key]):
                raise bad_request(f"{key} is not supported by minipaged; leave it out (got {json.dumps(value)[:80]})", key, "unsupported_parameter")
        elif key not in known:
            if key not in _LOGGED_UNKNOWN:
                _LOGGED_UNKNOWN.add(key)
                near = difflib.get_close_matches(key, sorted(known), n=1)
                log.warning("ignoring the unknown request field %r%s (logged once)", key, f" (did you mean {near[0]!r}?)" if near else "")
        else:
            body[key] = value
    try:
        req = cls.model_validate(body)
    except ValidationError as err:
        msg, param = _describe(err.errors(include_url=False)[0])
        raise bad_request(msg, param) from None
    if isinstance(req, CompletionRequest):
        p = req.prompt
        if isinstance(p, list) and not p:
            raise bad_request("prompt: an empty list is no prompt; give a string, token ids, or a list of them", "prompt")
        if isinstance(p, list) and isinstance(p[0], list) and any(not x for x in p):
            raise bad_request("prompt: one of the token-id prompts is empty", "prompt")
    else:
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs \"logprobs\": true", "top_logprobs")
        t = (req.chat_template_kwargs or {}).get("chat_template")
        if t is not None and not isinstance(t, str):
            raise bad_request(f"chat_template_kwargs.chat_template must be a string (a Jinja template), got {type(t).__name__}",
                              "chat_template_kwargs")
        if req.continue_final_message and (req.add_generation_prompt or req.messages[-1].role != "assistant"):
            raise bad_request("continue_final_message needs the last message to be the assistant's, and "
                              "\"add_generation_prompt\": false", "continue_final_message")
    return req


TOOL_PARSER_MISSING = ("tool_choice \"auto\" needs a tool parser to read tool calls out of the model's text, and this "
                       "server has none (vLLM starts one with --enable-auto-tool-choice --tool-call-parser NAME); send "
                       "tool_choice \"none\" to chat without tool calls, or leave tools out")


def check_tools(data: dict) -> None:
    """``tools`` are taken with ``tool_choice: "none"`` (the model answers in text; no tool is
    called); any other choice needs a tool parser, which minipaged has not: 400 saying so."""
    tools, choice = data.pop("tools", None), data.pop("tool_choice", None)
    data.pop("parallel_tool_calls", None)
    if tools is not None and not isinstance(tools, list):
        raise bad_request(f"tools must be a list of tool definitions, got {type(tools).__name__}", "tools")
    if choice not in (None, "none", "auto", "required") and not isinstance(choice, dict):
        raise bad_request(f"tool_choice must be \"none\", \"auto\", \"required\" or a named function, got {json.dumps(choice)[:60]}",
                          "tool_choice")
    if choice == "none" or (not tools and choice in (None, "auto")):
        return
    if choice in (None, "auto"):
        raise bad_request(TOOL_PARSER_MISSING, "tool_choice", "unsupported_parameter")
    raise bad_request(f"tool_choice {json.dumps(choice)[:60]} (a forced tool call) is not supported by minipaged: it has "
                      "no tool parser; send tool_choice \"none\", or ask for JSON with response_format", "tool_choice",
                      "unsupported_parameter")


def structured_outputs_of(req) -> Any:
    """The request's StructuredOutputsParams (None: free text) from ``response_format``
    (``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema": {"schema": ...}}``),
    ``structured_outputs`` (vLLM's object) or vLLM's older ``guided_*`` fields; at most one.
    A bad schema, regex or grammar is a 400 naming the error, before any work."""
    from ..structured_params import StructuredOutputsParams

    given: list[tuple[str, dict]] = []
    rf = req.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            schema = js.get("schema", js.get("json_schema")) if isinstance(js, dict) else None
            if not isinstance(schema, (dict, str)):
                raise bad_request("response_format: {\"type\": \"json_schema\"} needs \"json_schema\": {\"name\": ..., "
                                  "\"schema\": {...}}", "response_format")
            given.append(("response_format", {"json": schema}))
        elif kind != "text":
            raise bad_request(f"response_format type must be \"text\", \"json_object\" or \"json_schema\", got "
                              f"{json.dumps(kind)[:40]}", "response_format", "unsupported_parameter")
    if req.structured_outputs is not None:
        given.append(("structured_outputs", dict(req.structured_outputs)))
    for old, new in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        if getattr(req, old) is not None:
            given.append((old, {new: getattr(req, old)}))
    if not given:
        return None
    if len(given) > 1:
        raise bad_request(f"give one of response_format, structured_outputs and guided_*, not {[g for g, _ in given]}", given[1][0])
    name, fields = given[0]
    try:
        return StructuredOutputsParams.from_dict(fields)
    except (ValueError, TypeError) as e:
        raise bad_request(f"{name}: {e}", name) from None


def prompts_of(req) -> list[Any]:
    """The engine prompts a request asks for: one per choice group (a batch of prompts gives several).
    A chat is a list of messages; with vLLM's chat options (``add_generation_prompt=False``,
    ``continue_final_message``, ``chat_template``, ``chat_template_kwargs``) it is
    ``{"messages": [...], "add_generation_prompt": ..., ...}``, the form the engine renders."""
    if isinstance(req, ChatCompletionRequest):
        msgs = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
        options: dict[str, Any] = {}
        if not req.add_generation_prompt or req.continue_final_message:
            options.update(add_generation_prompt=req.add_generation_prompt, continue_final_message=req.continue_final_message)
        if req.chat_template is not None:
            options["chat_template"] = req.chat_template
        if req.chat_template_kwargs:
            options["chat_template_kwargs"] = dict(req.chat_template_kwargs)
        return [{"messages": msgs, **options}] if options else [msgs]
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if p and isinstance(p[0], int):
        return [token_prompt(p)]
    return [x if isinstance(x, str) else token_prompt(x) for x in p]


def token_prompt(ids: list[int]) -> list[int]:
    """Token ids as the engine takes them: a plain list of ints, which ``add_request`` range-checks
    (the ``{"prompt_token_ids": ...}`` form is not checked yet by today's engine)."""
    return list(ids)


def supports_n() -> bool:
    """Whether this engine's SamplingParams has parallel sampling (``n``)."""
    return any(f.name == "n" for f in dataclasses.fields(SamplingParams))


def sampling_params_of(req, default_max_tokens: int) -> SamplingParams:
    """The request's SamplingParams; an engine refusal (ValueError/TypeError) becomes a 400 naming the field."""
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise bad_request("give max_tokens or max_completion_tokens, not both", "max_tokens")
    max_tokens = req.max_tokens if req.max_tokens is not None else req.max_completion_tokens
    kw: dict[str, Any] = dict(
        max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p),
        top_k=0 if req.top_k is None else req.top_k,
        seed=req.seed,
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
    )
    for name in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        if getattr(req, name) is not None:
            kw[name] = float(getattr(req, name))
    if req.min_tokens:
        kw["min_tokens"] = req.min_tokens
    if req.allowed_token_ids is not None:
        kw["allowed_token_ids"] = list(req.allowed_token_ids)
    if req.logit_bias:
        try:
            kw["logit_bias"] = {int(k): float(v) for k, v in req.logit_bias.items()}
        except ValueError:
            raise bad_request(f"logit_bias: the keys must be token ids, got {sorted(req.logit_bias)[:5]}", "logit_bias") from None
    if isinstance(req, ChatCompletionRequest):
        if req.logprobs:
            kw["logprobs"] = req.top_logprobs or 0
    elif req.logprobs is not None:
        kw["logprobs"] = req.logprobs
        if req.echo:
            kw["prompt_logprobs"] = req.logprobs
    if req.prompt_logprobs is not None:
        kw["prompt_logprobs"] = req.prompt_logprobs
    so = structured_outputs_of(req)
    if so is not None:
        kw["structured_outputs"] = so
    if req.n != 1:
        if not supports_n():
            raise bad_request(f"n > 1 is not supported yet by this engine (got n={req.n}): send n separate requests", "n", "unsupported_parameter")
        kw["n"] = req.n
    try:
        return SamplingParams(**kw)
    except (ValueError, TypeError) as e:
        msg = str(e)
        field = next((k for k in kw if msg.startswith(k) or f"({k}=" in msg), None)
        raise bad_request(f"invalid sampling parameters: {e}", field) from None


# -- responses -----------------------------------------------------------------------------
def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def finish_reason(reason: str | None) -> str | None:
    """The engine's finish reasons, as an OpenAI client reads them ("abort" stays: vLLM sends it too)."""
    return reason


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage; ``cached_tokens`` (prompt tokens the prefix cache gave) goes in ``prompt_tokens_details``."""
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return u


def _token(tid: int, lp: Any, as_ids: bool = False) -> str:
    """A token as the response names it: its text, or ``token_id:<id>`` (vLLM's
    ``return_tokens_as_token_ids``, for tokens whose text alone is not valid UTF-8)."""
    if as_ids:
        return f"token_id:{tid}"
    t = getattr(lp, "decoded_token", None)
    return t if t is not None else f"token_id:{tid}"


def _top(entry: dict, n: int) -> list:
    """The top ``n`` of one position's {token id: Logprob}, by rank."""
    ranked = sorted(((lp.rank or 0, tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= n))
    return [(tid, lp) for _, tid, lp in ranked]


def chat_logprobs(entries: list, n: int, as_ids: bool = False) -> dict:
    """vLLM's per-token logprobs (a {token id: Logprob} per token, the chosen first) -> OpenAI's chat form."""
    content = []
    for entry in entries:
        tid, lp = next(iter(entry.items()))
        tok = _token(tid, lp, as_ids)
        content.append({"token": tok, "logprob": lp.logprob, "bytes": list(tok.encode("utf-8")),
                        "top_logprobs": [{"token": _token(t, x, as_ids), "logprob": x.logprob,
                                          "bytes": list(_token(t, x, as_ids).encode("utf-8"))}
                                         for t, x in _top(entry, n)]})
    return {"content": content}


def completion_logprobs(entries: list, n: int, offset: int = 0, as_ids: bool = False) -> dict:
    """The same -> OpenAI's legacy completions form (tokens, token_logprobs, top_logprobs, text_offset).
    An entry that is None (a prompt's first token, with echo) has no logprob."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for entry in entries:
        if entry is None:
            out["tokens"].append(None)
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            out["text_offset"].append(offset)
            continue
        tid, lp = next(iter(entry.items()))
        tok = _token(tid, lp, as_ids)
        out["tokens"].append(tok)
        out["token_logprobs"].append(lp.logprob)
        out["top_logprobs"].append({_token(t, x, as_ids): x.logprob for t, x in [(tid, lp)] + _top(entry, n)})
        out["text_offset"].append(offset)
        offset += len(tok)
    return out


def completion_body(kind: str, rid: str, model: str, choices: list[dict], prompt_tokens: int, completion_tokens: int, created: int) -> dict:
    """choices: [{"index", "text", "finish_reason", "logprobs"?}] -> a whole (non-streamed) response."""
    if kind == "chat":
        ch = [{"index": c["index"], "message": {"role": "assistant", "content": c["text"]}, "logprobs": c.get("logprobs"),
               "finish_reason": c["finish_reason"]} for c in choices]
        obj = "chat.completion"
    else:
        ch = [{"index": c["index"], "text": c["text"], "logprobs": c.get("logprobs"), "finish_reason": c["finish_reason"]} for c in choices]
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": ch, "usage": usage(prompt_tokens, completion_tokens)}


def chunk(kind: str, rid: str, model: str, created: int, index: int, text: str | None, reason: str | None, first: bool = False,
          logprobs: dict | None = None, usage_so_far: dict | None = None) -> dict:
    """One streamed chunk for one choice (OpenAI's ``text_completion`` / ``chat.completion.chunk``);
    ``usage_so_far``: vLLM's ``continuous_usage_stats``."""
    if kind == "chat":
        delta: dict = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
        body = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
    if usage_so_far is not None:
        body["usage"] = usage_so_far
    return body


def usage_chunk(kind: str, rid: str, model: str, created: int, prompt_tokens: int, completion_tokens: int) -> dict:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage(prompt_tokens, completion_tokens)}


def sse(data: dict | str) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


def now() -> int:
    return int(time.time())
