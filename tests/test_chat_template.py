"""Chat templates rendered as transformers' apply_chat_template renders them; ChatML when a model has none."""

import pytest

from dflash_jax.chat_template import CHATML, TemplateError, render

# A Qwen3-style template: system handling, string checks, namespace, loop.last, tojson, raise_exception and the
# enable_thinking switch (an empty think block when thinking is off).
QWEN_STYLE = """{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(users=0) %}
{%- for message in messages %}
    {%- if message.content is not string %}{{- raise_exception('content must be a string') }}{%- endif %}
    {%- if message.role == 'user' %}{%- set ns.users = ns.users + 1 %}{%- endif %}
    {%- if message.role != 'system' %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content }}
        {%- if message.meta is defined %}{{- ' ' + message.meta | tojson }}{%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Write a haiku about GPUs"}]


def transformers_render(template, messages, **kwargs):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))
    return hf.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)


@pytest.mark.parametrize("template", [QWEN_STYLE, CHATML])
@pytest.mark.parametrize("kwargs", [dict(add_generation_prompt=True), dict(add_generation_prompt=False),
                                    dict(add_generation_prompt=True, enable_thinking=False),
                                    dict(add_generation_prompt=True, enable_thinking=True)])
def test_same_text_as_transformers(template, kwargs):
    assert render(MESSAGES, template, **kwargs) == transformers_render(template, MESSAGES, **kwargs)


def test_tojson_keeps_unicode_like_transformers():
    messages = [{"role": "user", "content": "café", "meta": {"lang": "français"}}]
    assert render(messages, QWEN_STYLE) == transformers_render(QWEN_STYLE, messages, add_generation_prompt=True)
    assert '"français"' in render(messages, QWEN_STYLE)


def test_chatml_fallback():
    assert render([{"role": "user", "content": "Hi"}]) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert render([{"role": "user", "content": "Hi"}], enable_thinking=False).endswith(
        "assistant\n<think>\n\n</think>\n\n")


def test_errors():
    with pytest.raises(TemplateError, match="refused the messages: content must be a string"):
        render([{"role": "user", "content": ["a list"]}], QWEN_STYLE)
    with pytest.raises(TemplateError, match="does not parse"):
        render(MESSAGES, "{% for m in messages %}")
    with pytest.raises(TemplateError, match="needs 'role' and 'content'"):
        render([{"content": "no role"}])
