"""Request fields beyond what the request models declare: vLLM's extension fields and OpenAI's
own unserved ones. Each is honoured or refused, none ignored.

OpenAI clients send vLLM's extra fields through ``extra_body``, and the request models accept
unknown fields (``extra="allow"``). A vLLM field that this server does not implement would then
change nothing without a word, so every such field is listed here with the value at which it
changes nothing (vLLM's default); a request that gives another value gets a 400 naming the field,
and so does a field that is neither declared nor vLLM's nor OpenAI's.
A field that a request model declares (``top_k``, ``min_p``, ``add_special_tokens`` of
completions, ``cache_salt``, the structured-output fields of ``structured.py``, ...) is honoured
by it and never refused here, so declaring a field is all it takes to serve one of these; the
table keeps such fields (marked honoured below) so that it stays the whole list of vLLM's
names, each honoured or refused.

OpenAI's own request fields that no model declares (``OPENAI_FIELDS``: audio output, predicted
outputs, reasoning effort, the deprecated ``functions`` / ``function_call``, ...) are refused by
name with the reason, unless null (OpenAI's "not set"). OpenAI's service options that can be
honoured at some values (``store``, ``metadata``, ``service_tier``, ``modalities``) are declared
by ``protocol.ChatCompletionRequest`` instead.

The names are those of vLLM's ``ChatCompletionRequest`` and ``CompletionRequest``
(``vllm/entrypoints/openai/protocol.py``, v0.6-v0.10) and of OpenAI's API reference for
``/v1/chat/completions``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from .errors import unsupported

_ANY = object()  # no value is a no-op: any value given (null aside) is refused

# Field → the value at which it changes nothing. Why each undeclared one is refused:
VLLM_FIELDS: dict[str, Any] = {
    # decoding the engine does not do
    "use_beam_search": False,
    "length_penalty": 1.0,
    "prompt_logprobs": _ANY,  # the OpenAI form, echo + logprobs, is served on completions
    "truncate_prompt_tokens": _ANY,
    "priority": 0,
    "logits_processors": _ANY,
    "return_tokens_as_token_ids": False,
    "return_token_ids": False,
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    # structured outputs and token masks: honoured (declared by structured.StructuredOutputFields;
    # guided_decoding_backend takes only auto / guidance: one backend serves all) ...
    "guided_json": _ANY,
    "guided_regex": _ANY,
    "guided_choice": _ANY,
    "guided_grammar": _ANY,
    "guided_decoding_backend": _ANY,
    "structured_outputs": _ANY,
    "allowed_token_ids": _ANY,
    "bad_words": [],
    # ... except a JSON whitespace pattern: JSON output is always compact here
    "guided_whitespace_pattern": _ANY,
    # prompt rendering: the served chat template is the model directory's, rendered by the
    # tokenizer model with the generation prompt. A per-request Jinja template is refused: it
    # would run client-supplied template code in the server.
    "chat_template": _ANY,
    "add_generation_prompt": True,
    "continue_final_message": False,
    "documents": _ANY,
    "mm_processor_kwargs": _ANY,
    "echo": False,  # chat's echo (completions declares its own)
    "add_special_tokens": False,  # chat's (completions declares its own)
    # disaggregated serving (refused) and cache isolation (cache_salt: honoured, protocol.py)
    "kv_transfer_params": _ANY,
    "cache_salt": _ANY,
}


# OpenAI's chat request fields that this server does not serve (no request model declares
# them) → why, or what to use instead.
OPENAI_FIELDS: dict[str, str] = {
    "audio": "it generates text only (no audio output)",
    "prediction": "predicted outputs are not implemented",
    "reasoning_effort": "the served models take no reasoning effort (Qwen3's thinking is "
    "chat_template_kwargs.enable_thinking)",
    "verbosity": "the served models take no verbosity setting",
    "web_search_options": "it has no web search",
    "functions": "deprecated by OpenAI; give tools instead",
    "function_call": "deprecated by OpenAI; give tool_choice instead",
}


def _same(value: Any, noop: Any) -> bool:
    # JSON 1 is no `true`: a boolean no-op takes only a boolean.
    return value == noop and (type(noop) is not bool or type(value) is bool)


def check_extensions(request: BaseModel) -> None:
    """Refuse every vLLM field of ``request`` that it does not declare and that is given with
    a value other than its no-op one, every undeclared OpenAI field given a value
    (``OPENAI_FIELDS``; null is OpenAI's "not set"), and every field that is none of these (as
    OpenAI does: "Unrecognized request argument").

    Raises:
        OpenAIError: 400 ``unsupported_parameter`` naming the first such field (an OpenAI
            field's message says why, or what to use instead).
    """
    extra = request.model_extra or {}
    for name, noop in VLLM_FIELDS.items():
        if name in type(request).model_fields or name not in extra:
            continue
        value = extra[name]
        if value is None or (noop is not _ANY and _same(value, noop)):
            continue
        raise unsupported(name)
    for name, value in extra.items():
        if name in OPENAI_FIELDS:
            if value is not None:
                raise unsupported(name, reason=OPENAI_FIELDS[name])
        elif name not in VLLM_FIELDS:  # unrecognized: neither vLLM's nor OpenAI's
            raise unsupported(name)
