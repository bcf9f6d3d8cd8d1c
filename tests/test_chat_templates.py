"""Prompts come from each model's own chat template; template options (Qwen3's
``enable_thinking``) are passed only where the template has them, and refused elsewhere."""

from __future__ import annotations

import openai
import pytest

from tritonllm.tokenization.chat import render_prompt, template_uses

SMOLLM2_HI = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
)


def test_smollm2_prompt_is_its_chatml_with_the_default_system_prompt(smollm2_tokenizer):
    ids = render_prompt(smollm2_tokenizer, messages=[{"role": "user", "content": "Hi"}])
    assert smollm2_tokenizer.decode(ids) == SMOLLM2_HI
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = smollm2_tokenizer.decode(render_prompt(smollm2_tokenizer, messages=system))
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n") and "SmolLM" not in text


def test_enable_thinking_only_where_the_template_has_it(smollm2_tokenizer, tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    assert not template_uses(smollm2_tokenizer.chat_template, "enable_thinking")
    with pytest.raises(ValueError, match="enable_thinking is not supported"):
        render_prompt(smollm2_tokenizer, messages=messages, enable_thinking=False)
    # The tiny Qwen3 checkpoint's template has the switch: off pre-fills an empty think block.
    assert template_uses(tokenizer.chat_template, "enable_thinking")
    on = tokenizer.decode(render_prompt(tokenizer, messages=messages))
    off = tokenizer.decode(render_prompt(tokenizer, messages=messages, enable_thinking=False))
    assert off == on + "<think>\n\n</think>\n\n"
    assert render_prompt(tokenizer, messages=messages, enable_thinking=True) == render_prompt(
        tokenizer, messages=messages
    )


def test_service_refuses_enable_thinking_for_smollm2(smollm2_service):
    client = openai.OpenAI(base_url=smollm2_service.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="enable_thinking"):
        client.chat.completions.create(
            model=smollm2_service.model_name,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
