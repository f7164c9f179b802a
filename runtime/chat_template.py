"""A conversation through the engine's chat template: the one place that renders chat messages
into a prompt, for `LLM.chat` (runtime/llm.py), POST /v1/chat/completions and POST /tokenize
(runtime/serving/async_engine.py) and `infhip-run --chat` (runtime/cli.py).

Messages are OpenAI's (``{"role": ..., "content": ...}``, an assistant's ``tool_calls`` with
their ``arguments`` as JSON text, which templates read as objects: serving/tool_calls.py's
``template_messages``). The rendered text ends with the assistant's turn opened
(``add_generation_prompt``) unless ``chat_template_kwargs`` says otherwise, and is tokenized
without adding special tokens: the template writes them (BOS, role markers), as vLLM does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# Keywords of apply_chat_template the caller may not set through chat_template_kwargs (we set
# them: rendering text, then tokenizing it once).
_RESERVED = ("tokenize", "conversation", "tools", "return_dict", "return_tensors")


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (no template, bad messages, the template refused them)."""


def check_messages(messages) -> list[dict]:
    """One conversation as a list of dicts, each with a string ``role``; ChatTemplateError otherwise."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise ChatTemplateError(f"a conversation is a non-empty list of messages (dicts), got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ChatTemplateError(f"message {i} must be a dict with a string 'role', got {m!r:.80}")
        m = dict(m)
        if isinstance(m.get("content"), list):  # OpenAI's text parts, joined as the chat endpoint joins them
            try:
                m["content"] = "".join(p["text"] for p in m["content"] if p.get("type", "text") == "text")
            except (TypeError, KeyError, AttributeError):
                raise ChatTemplateError(f"message {i}: content parts must be {{\"type\": \"text\", \"text\": ...}}") from None
        out.append(m)
    return out


def render_chat(tokenizer, messages, tools: list[dict] | None = None,
                chat_template_kwargs: Mapping | None = None) -> tuple[str, list[int]]:
    """(text, token ids) of one conversation through ``tokenizer``'s chat template.

    ``chat_template_kwargs``: extra keywords of the template (``add_generation_prompt``,
    ``enable_thinking``, ...), as vLLM's ``chat_template_kwargs``."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("this engine's tokenizer has no chat template; send a plain prompt "
                                "(LLM.generate, POST /v1/completions)")
    kwargs = dict(chat_template_kwargs or {})
    bad = sorted(k for k in kwargs if k in _RESERVED or not isinstance(k, str))
    if bad:
        raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(map(str, bad))}")
    kwargs.setdefault("add_generation_prompt", True)
    conversation = check_messages(messages)
    if any(m.get("tool_calls") for m in conversation):  # no tool calls: serving/tool_calls.py stays off
        from infhip.runtime.serving.tool_calls import template_messages
        conversation = template_messages(conversation)
    try:
        text = tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False, **kwargs)
    except Exception as e:  # noqa: BLE001 - jinja's errors ("roles must alternate") are the caller's
        raise ChatTemplateError(f"the chat template refused the messages: {e}") from None
    return text, tokenizer(text, add_special_tokens=False)["input_ids"]


def is_one_conversation(messages) -> bool:
    """Whether ``messages`` is one conversation (a list of dicts) rather than a list of them."""
    return isinstance(messages, Sequence) and bool(messages) and isinstance(messages[0], Mapping)
