"""The text of one generator response: what the ``llm`` ensemble answers for it.

Two places turn a generator response (new ids, the ids before them, the stop-string trim, the
echoed prompt, logprobs) into ``llm``'s text outputs: the ``detokenizer`` model, the last step of
``llm``, and the generator itself when its request asks for ``text_output`` (the ``llm_fused``
ensemble, which has no detokenizer step: one Python step fewer per streamed response,
BENCHMARKS.md "The fused ensemble"). Both call ``text_outputs``, so both paths answer the same
text, logprobs and prompt logprobs for the same ids.
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
            ``logprobs.content`` list of the new ids as JSON.
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
    final: bool,
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
        final: the choice's last response (an incomplete UTF-8 character is flushed).
        trim_chars: characters dropped from the end of the delta (a matched stop string).
        echo_text: text put before the delta (the prompt, in a choice's first response).
        logprobs: ``(logprobs [num_ids], top_ids [num_ids * k], top_logprobs [num_ids * k])``
            (row-major, most likely first), or None; empty logprobs count as none.
        prompt_scores: ``(prompt_ids [P], logprobs [P - 1], top_ids [(P - 1) * k],
            top_logprobs [(P - 1) * k])``, or None.
    Raises:
        ValueError: logprob lengths that do not match the ids (``logprob_entries``).
    """
    text = detokenizer.delta(prefix_ids, new_ids, final)
    if trim_chars:
        text = apply_trim(text, trim_chars)
    if echo_text is not None:
        text = echo_text + text
    logprobs_json = ""
    if logprobs is not None and len(logprobs[0]):
        entries = logprob_entries(detokenizer.logprob_token_bytes, new_ids, *logprobs)
        logprobs_json = json.dumps(entries, ensure_ascii=False)
    prompt_json = None
    if prompt_scores is not None:
        entries = prompt_logprob_entries(detokenizer.logprob_token_bytes, *prompt_scores)
        prompt_json = json.dumps(entries, ensure_ascii=False)
    return TextOutputs(text, logprobs_json, prompt_json)
