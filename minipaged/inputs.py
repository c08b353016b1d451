"""Input processing (vLLM's ``Processor``): a prompt in any form it takes -> token ids, and every
check a request passes before the engine queues it (its SamplingParams, prompt and request id).

Owns the prompt forms, the chat template and the encodability checks. It does not own the queue
(the engine's) nor the text that comes back (output_processor.py).
"""
from __future__ import annotations

from typing import Any

import torch

from .parts import declared_support
from .sampling import SamplingParams

CHAT_OPTIONS = ("add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs")


def check_encodable(text: str, what: str) -> str:
    """``text`` if UTF-8 can encode it; else a ValueError naming the lone surrogate and its position
    (tokenizers say only "TextInputSequence must be str")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{what} holds a lone surrogate {ascii(text[e.start])[1:-1]} at position {e.start}, which no text encoding "
            "can carry (it usually comes from bytes decoded with errors='surrogateescape'): fix the string, e.g. "
            "text.encode('utf-8', 'replace').decode()"
        ) from None
    return text


def is_token_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def is_chat(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(m, dict) and "role" in m for m in x)


def is_chat_request(x: Any) -> bool:
    """``{"messages": [...], "add_generation_prompt": ..., "continue_final_message": ..., "chat_template": ...}``"""
    return isinstance(x, dict) and "messages" in x and set(x) <= {"messages", *CHAT_OPTIONS}


def chat_messages(messages: Any) -> list[dict]:
    """Chat messages with their content as one string (OpenAI's text parts joined)."""
    if not is_chat(messages):
        raise TypeError("a conversation is a non-empty list of {'role', 'content'} dicts")
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                             for p in content):
            content = "".join(p["text"] for p in content)
        if set(m) - {"role", "content", "name"} or not isinstance(content, str) or not isinstance(m.get("role"), str):
            raise ValueError(f"a chat message is {{'role': str, 'content': str or [{{'type': 'text', 'text': str}}, ...]}}, got {m!r}")
        check_encodable(content, f"message {i}'s content")
        check_encodable(m["role"], f"message {i}'s role")
        out.append({**m, "content": content})
    return out


def check_ids(ids: list[int], vocab: int) -> list[int]:
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token ids must be in 0..{vocab - 1}; got {bad[:5]}")
    return list(ids)


class InputProcessor:
    """One engine's prompts -> token ids, with its tokenizer (None: token ids only) and the
    model's vocabulary size; and the checks of a request's SamplingParams against them."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    def need_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise ValueError(f"this engine has no tokenizer, so it cannot take {what}: pass token ids instead")

    def encode_prompt(self, prompt: Any) -> list[int]:
        """One prompt -> token ids. The forms (and nothing else):

        - a string: a text prompt, tokenized as it is;
        - ``{"prompt": "..."}``: the same, as a dict;
        - ``{"prompt_token_ids": [int, ...]}`` or a list of ints: token ids, used as they are;
        - a list of chat messages (``{"role": ..., "content": ...}`` dicts, the content a string or
          OpenAI's ``[{"type": "text", "text": ...}]`` parts): rendered with the model's chat
          template, with the assistant's turn opened;
        - ``{"messages": [...], "add_generation_prompt": bool, "continue_final_message": bool,
          "chat_template": str}``: the same, with vLLM's chat options (see ``render_chat``).
        """
        if isinstance(prompt, str):
            self.need_tokenizer("a text prompt")
            return self.tokenizer.encode(check_encodable(prompt, "the prompt"))
        if isinstance(prompt, dict):
            return self._encode_dict(prompt)
        if is_token_list(prompt):
            return check_ids(prompt, self.vocab_size)
        if is_chat(prompt):
            return self.tokenizer.encode(check_encodable(self.render_chat(prompt), "the chat"))
        hint = ""
        if isinstance(prompt, (bytes, bytearray)):
            hint = ": decode bytes to a str first"
        elif isinstance(prompt, torch.Tensor):
            hint = ": pass tensor.tolist() for token ids"
        elif isinstance(prompt, tuple):
            hint = ": pass a list"
        raise TypeError(
            f"a prompt must be a string, {{'prompt_token_ids': [...]}}, a list of token ids or a list of chat "
            f"messages; got {type(prompt).__name__}{hint}"
        )

    def _encode_dict(self, prompt: dict) -> list[int]:
        """``{"prompt_token_ids": [...]}``, ``{"prompt": "..."}`` or a chat request -> token ids."""
        keys = set(prompt)
        if keys == {"prompt_token_ids"}:
            ids = prompt["prompt_token_ids"]
            if not is_token_list(ids):
                raise TypeError(f"prompt_token_ids must be a list of ints, got {type(ids).__name__}: {str(ids)[:60]}")
            return check_ids(ids, self.vocab_size)
        if keys == {"prompt"}:
            if not isinstance(prompt["prompt"], str):
                raise TypeError(f"{{'prompt': ...}} takes a string, got {type(prompt['prompt']).__name__}")
            return self.encode_prompt(prompt["prompt"])
        if is_chat_request(prompt):
            options = {k: prompt[k] for k in CHAT_OPTIONS if k in prompt}
            return self.tokenizer.encode(check_encodable(self.render_chat(prompt["messages"], **options), "the chat"))
        if "role" in keys:
            raise TypeError("one chat message is not a prompt: give the conversation as a list of messages")
        raise TypeError(
            f"a prompt dict takes exactly one key, 'prompt' or 'prompt_token_ids'; got keys {sorted(map(str, keys))}"
        )

    def render_chat(self, messages: Any, add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template: str | None = None, chat_template_kwargs: dict | None = None) -> str:
        """A conversation as prompt text, in the model's chat template (or ``chat_template``, a Jinja
        string), as vLLM's ``LLM.chat`` renders it: ``add_generation_prompt`` opens the assistant's
        turn; ``continue_final_message`` leaves the last (assistant) message open, to be continued;
        ``chat_template_kwargs`` are more variables for the template (e.g. ``enable_thinking``).
        A template that does not compile or render is a ValueError starting "chat_template:"."""
        self.need_tokenizer("chat messages")
        msgs = chat_messages(messages)
        if not isinstance(add_generation_prompt, bool) or not isinstance(continue_final_message, bool):
            raise TypeError("add_generation_prompt and continue_final_message are True or False")
        if continue_final_message and (add_generation_prompt or msgs[-1]["role"] != "assistant"):
            raise ValueError("continue_final_message=True needs add_generation_prompt=False and the assistant's message last")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise TypeError(f"chat_template_kwargs is a dict of template variables, got {type(chat_template_kwargs).__name__}")
        if chat_template is None and not chat_template_kwargs:
            text = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt)
        else:
            text = self._render_template(msgs, add_generation_prompt, chat_template, chat_template_kwargs)
        if continue_final_message:
            last = msgs[-1]["content"]
            end = text.rfind(last)
            if end >= 0:
                text = text[: end + len(last)]
        return text

    def _render_template(self, msgs: list[dict], add_generation_prompt: bool, chat_template: str | None,
                         chat_template_kwargs: dict | None) -> str:
        """``msgs`` through a Jinja template of the caller's (or the model's, with extra variables)."""
        if chat_template is not None and not isinstance(chat_template, str):
            raise TypeError(f"chat_template is a Jinja template string, got {type(chat_template).__name__}")
        import jinja2

        from .model.tokenizer import _render_chat_template

        tok = self.tokenizer
        kwargs = dict(chat_template_kwargs or {})
        template = chat_template if chat_template is not None else kwargs.get("chat_template") or getattr(tok, "chat_template", None)
        if not isinstance(template, (str, type(None))):
            raise TypeError(f"chat_template is a Jinja template string, got {type(template).__name__}")
        if not template:
            raise ValueError("chat_template: the model has no chat template; pass one (a Jinja string)")
        # vLLM's order: the request's kwargs are applied over the standard variables
        context = dict(messages=msgs, add_generation_prompt=add_generation_prompt,
                       bos_token=getattr(tok, "bos_token", None) or "", eos_token=getattr(tok, "eos_token", None) or "")
        context.update({k: v for k, v in kwargs.items() if k not in ("chat_template", "messages")})
        try:
            text = _render_chat_template(template, **context)
        except Exception as e:  # noqa: BLE001 - a template is user content: whatever it raises is its fault
            where = f" (line {e.lineno})" if isinstance(e, jinja2.TemplateSyntaxError) and e.lineno else ""
            raise ValueError(f"chat_template: the chat template failed to render{where}: {type(e).__name__}: {e}") from None
        if not isinstance(text, str):
            raise ValueError("chat_template: the chat template did not render to text")
        return text

    def prompt_text(self, prompt: Any) -> str | None:
        """``RequestOutput.prompt``: the prompt as text (a chat rendered); None for token ids, as in vLLM."""
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return prompt["prompt"]
        try:
            if is_chat(prompt):
                return self.render_chat(prompt)
            if is_chat_request(prompt):
                return self.render_chat(prompt["messages"], **{k: prompt[k] for k in CHAT_OPTIONS if k in prompt})
        except (TypeError, ValueError):
            return None
        return None

    def check_params(self, sampling_params: SamplingParams | None, max_num_seqs: int) -> SamplingParams:
        """The request's SamplingParams (None: the defaults), validated again (a field may have been
        set since they were made) and checked against this engine: its vocabulary, its tokenizer,
        how many sequences run at once."""
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        vocab = self.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids must be in 0..{vocab - 1}; got {bad[:5]}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this engine has none: use stop_token_ids")
        for j, stop in enumerate([params.stop] if isinstance(params.stop, str) else params.stop or ()):
            check_encodable(stop, f"stop string {j}")
        if params.n > max_num_seqs:  # before any sample is made: n=2**40 costs nothing
            raise ValueError(
                f"SamplingParams(n={params.n}) asks for {params.n} samples, but max_num_seqs={max_num_seqs} "
                f"sequences run at once: lower n to at most {max_num_seqs}, or raise max_num_seqs"
            )
        return params


def check_parallel_sampling(params: SamplingParams, scheduler: Any) -> None:
    """``n > 1`` needs a scheduler that declares it seats every sample (minipaged's does)."""
    if params.n > 1 and "parallel_sampling" not in declared_support(type(scheduler), "schedule"):
        raise ValueError(
            f"SamplingParams(n={params.n}) needs a scheduler whose schedule() gives every sample a seat, and "
            f"{type(scheduler).__name__}.schedule does not declare it (supports = {{'parallel_sampling'}}): "
            "send n separate requests instead (seeds seed, seed + 1, ...), or use minipaged's Scheduler"
        )


def check_request_id(request_id: Any) -> str:
    if isinstance(request_id, bool) or not isinstance(request_id, (str, int)) or str(request_id) == "":
        raise TypeError(f"request_id must be a non-empty string, got {request_id!r}")
    return str(request_id)


def fit_max_tokens(params: SamplingParams, given: bool, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
    """``params`` with ``max_tokens`` that fits the context: None resolved to the room left (on a
    copy, the request's own); a number that does not fit refused when the caller ``given`` the
    params, else (the engine's defaults) cut to the room."""
    if params.max_tokens is None:  # to the context's end: this request's own copy says how far
        params = params.clone()
        params.max_tokens = params.max_tokens_for(num_prompt_tokens, max_model_len)
    room = max_model_len - num_prompt_tokens  # <= 0: the scheduler rejects the prompt, saying why
    if 0 < room < params.max_tokens:
        if given:
            raise ValueError(
                f"max_tokens={params.max_tokens} does not fit: the model's context is {max_model_len} "
                f"tokens and the prompt has {num_prompt_tokens}, which leaves {room} (prompt + max_tokens = "
                f"{num_prompt_tokens + params.max_tokens}): lower max_tokens to at most {room}, pass max_tokens=None "
                "for the rest of the context, or shorten the prompt"
            )
        params.max_tokens = room  # no params given: the default ends within the context
    return params


def request_args(args: tuple, request_id: Any, prompt: Any, params: Any, sampling_params: Any) -> tuple:
    """(request_id, prompt, sampling_params) from either order of ``add_request``'s arguments."""
    if params is not None and sampling_params is not None:
        raise TypeError("add_request got both params and sampling_params: give one")
    sp = params if params is not None else sampling_params
    args = list(args)
    if len(args) > 3:
        raise TypeError(f"add_request takes (request_id, prompt, params) or (prompt, params), got {len(args)} arguments")
    old = (len(args) >= 2 and (args[1] is None or isinstance(args[1], SamplingParams))) or (len(args) == 1 and prompt is None)
    if old:  # (prompt, params, request_id)
        names = ["prompt", "sampling_params", "request_id"]
    else:  # vLLM's (request_id, prompt, params)
        names = ["request_id", "prompt", "sampling_params"]
    given = {"request_id": request_id, "prompt": prompt, "sampling_params": sp}
    for name, value in zip(names, args):
        if given[name] is not None:
            raise TypeError(f"add_request got {name} twice")
        given[name] = value
    if given["prompt"] is None:
        raise TypeError("add_request needs a prompt: add_request(request_id, prompt, params)")
    return given["request_id"], given["prompt"], given["sampling_params"]


def as_prompt_list(prompts: Any) -> list:
    """``LLM.generate``'s input: one prompt (see LLMEngine.encode_prompt) or a list of prompts."""
    if isinstance(prompts, (str, dict)) or is_token_list(prompts) and prompts or is_chat(prompts):
        return [prompts]
    if isinstance(prompts, list):
        if not prompts:
            return []
        if any(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
            raise TypeError(
                "a list that mixes token ids with other things: give one prompt's token ids as a list of ints, "
                "or many prompts as a list of prompts"
            )
        return list(prompts)
    hint = {bytes: "decode it to a str", bytearray: "decode it to a str", tuple: "pass a list"}.get(type(prompts), "")
    if isinstance(prompts, torch.Tensor):
        hint = "pass tensor.tolist() (one row of token ids per prompt)"
    raise TypeError(
        f"generate() takes a prompt (a string, {{'prompt_token_ids': [...]}}, token ids, chat messages) or a "
        f"list of prompts; got {type(prompts).__name__}{hint and ': ' + hint}"
    )


def chat_prompts(messages: Any, chat_template: str | None, add_generation_prompt: bool, continue_final_message: bool,
                 chat_template_content_format: str, chat_template_kwargs: dict | None) -> list:
    """``LLM.chat``'s input (one conversation or a list of them, and vLLM's chat options) as
    prompts ``generate`` takes: a conversation, or a chat request dict when an option is set."""
    if is_chat(messages):
        messages = [messages]
    if not isinstance(messages, list) or not all(is_chat(m) for m in messages):
        raise TypeError("chat() takes a conversation (a list of {'role', 'content'} dicts) or a list of conversations")
    if chat_template_content_format not in ("auto", "string", "openai"):
        raise ValueError(f"chat_template_content_format is 'auto', 'string' or 'openai', got {chat_template_content_format!r}")
    options = {}
    if chat_template is not None:
        options["chat_template"] = chat_template
    if add_generation_prompt is not True:
        options["add_generation_prompt"] = add_generation_prompt
    if continue_final_message:
        options["continue_final_message"] = continue_final_message
    if chat_template_kwargs:
        options["chat_template_kwargs"] = chat_template_kwargs
    return [{"messages": m, **options} for m in messages] if options else messages
