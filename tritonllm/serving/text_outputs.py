"""The text of one generator response: what the ``llm`` ensemble answers for it.

Two places turn a generator response (new ids, the ids before them, the stop-string trim, the
echoed prompt, logprobs) into ``llm``'s text outputs: the ``detokenizer`` model, the last step of
``llm``, and the generator itself when its request asks for ``text_output`` (the ``llm_fused``
ensemble, which has no detokenizer step: one Python step fewer per streamed response,
BENCHMARKS.md "The fused ensemble"). Both call ``text_outputs``, so both paths answer the same
text, logprobs and prompt logprobs for the same ids.

Logprobs cover the tokens of the returned text, as OpenAI's ``logprobs.content`` does: a choice
that ends with "stop" reports no entry for the token that stopped it when that token is no part
of the text (an EOS or other special stop id), nor for the tokens that lie wholly after the cut
made for a stop string (a token straddling the cut keeps its entry). Every generated token still
counts in ``num_output_tokens``, as OpenAI and vLLM count completion tokens.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from tritonllm.engine.stop_strings import apply_trim
from tritonllm.serving.logprobs import logprob_entries, prompt_logprob_entries
from tritonllm.tokenization.detokenizer import Detokenizer


@dataclass(frozen=True, slots=True)
class TextOutputs:
    """``llm``'s text outputs of one response.

    Attributes:
        text: ``text_output``: the echoed prompt (when given), then the text delta of the new
            ids less the trimmed characters.
        logprobs_json: ``logprobs_json``: ``""`` without logprobs, else OpenAI's chat
            ``logprobs.content`` list of the new ids that belong to the returned text
            (``content_token_count``) as JSON.
        prompt_logprobs_json: ``prompt_logprobs_json`` (the prompt's entries as JSON, the first
            with logprob null) when the response carries the prompt's scores, else None.
    """

    text: str
    logprobs_json: str = ""
    prompt_logprobs_json: str | None = None


def text_outputs(
    detokenizer: Detokenizer,
    new_ids: Sequence[int],
    prefix_ids: Sequence[int],
    finish_reason: str,
    trim_chars: int = 0,
    echo_text: str | None = None,
    logprobs: tuple[Sequence[float], Sequence[int], Sequence[float]] | None = None,
    prompt_scores: tuple[Sequence[int], Sequence[float], Sequence[int], Sequence[float]]
    | None = None,
) -> TextOutputs:
    """The text outputs of one response of a choice.

    Args:
        detokenizer: the served tokenizer's ``Detokenizer``.
        new_ids: ``[num_ids]`` this response's ids; prefix_ids: up to ``PREFIX_LEN`` ids of
            the same choice before them.
        finish_reason: ``""`` while the choice runs, else its finish_reason (its last
            response: an incomplete UTF-8 character is flushed).
        trim_chars: characters dropped from the end of the delta (a matched stop string).
        echo_text: text put before the delta (the prompt, in a choice's first response).
        logprobs: ``(logprobs [num_ids], top_ids [num_ids * k], top_logprobs [num_ids * k])``
            (row-major, most likely first), or None; empty logprobs count as none.
        prompt_scores: ``(prompt_ids [P], logprobs [P - 1], top_ids [(P - 1) * k],
            top_logprobs [(P - 1) * k])``, or None.
    Raises:
        ValueError: logprob lengths that do not match the ids (``logprob_entries``).
    """
    delta = detokenizer.delta(prefix_ids, new_ids, finish_reason != "")
    text = apply_trim(delta, trim_chars) if trim_chars else delta
    logprobs_json = ""
    if logprobs is not None and len(logprobs[0]):
        entries = logprob_entries(detokenizer.logprob_token_bytes, new_ids, *logprobs)
        count = content_token_count(
            detokenizer, new_ids, prefix_ids, finish_reason, trim_chars, len(delta)
        )
        # Strict JSON: the entries' numbers are finite (wire_logprob), never NaN or Infinity.
        logprobs_json = json.dumps(entries[:count], ensure_ascii=False, allow_nan=False)
    if echo_text is not None:
        text = echo_text + text
    prompt_json = None
    if prompt_scores is not None:
        entries = prompt_logprob_entries(detokenizer.logprob_token_bytes, *prompt_scores)
        prompt_json = json.dumps(entries, ensure_ascii=False, allow_nan=False)
    return TextOutputs(text, logprobs_json, prompt_json)


def content_token_count(
    detokenizer: Detokenizer,
    new_ids: Sequence[int],
    prefix_ids: Sequence[int],
    finish_reason: str,
    trim_chars: int,
    delta_chars: int,
) -> int:
    """How many of a response's ``new_ids``, from the first, belong to the returned text.

    All of them, except in a choice's last response when it finished with "stop": then the
    id that stopped it (the last one) is left out when it decodes to no text (EOS or another
    special stop id; a stop id with text is part of the output), and after a stop string's
    cut (``trim_chars``) the ids whose text starts at or after the cut are left out. A
    character belongs to the ids that hold its bytes, so an id that holds only the first bytes
    of the stop string's first character lies after the cut too.

    Args:
        detokenizer, new_ids, prefix_ids, finish_reason, trim_chars: as ``text_outputs``.
        delta_chars: characters of the response's decoded delta, before the trim.
    """
    count = len(new_ids)
    if finish_reason != "stop" or not count:
        return count
    if not trim_chars:  # no stop string: the last id is the stop token (or the grammar's end)
        return count - 1 if not detokenizer.token_bytes(new_ids[-1:]) else count
    # The cut lies in this response: released text before it is always part of the answer
    # (engine/stop_strings.py), and a stop string's tokens are released together.
    cut = delta_chars - trim_chars
    while count and len(detokenizer.delta(prefix_ids, new_ids[: count - 1], False)) >= cut:
        count -= 1
    return count
