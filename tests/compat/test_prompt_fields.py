"""Prompt fields of vLLM's chat API on a plain LM: `chat_template` replaces the model's template,
`chat_template_kwargs` are its variables; both only with chat messages."""
from __future__ import annotations

import pytest

from vllm_omni.inputs import parse_prompt
from vllm_omni.multimodal.input_processors import TextInputProcessor

TEMPLATE = "{% if greeting is defined %}{{ greeting }} {% endif %}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
MESSAGES = [{"role": "user", "content": "hi"}, {"role": "user", "content": [{"type": "text", "text": "there"}]}]


@pytest.fixture(scope="module")
def processor(tiny_model):
    from transformers import AutoTokenizer

    return TextInputProcessor(AutoTokenizer.from_pretrained(tiny_model("qwen2")))


def test_template_and_its_variables(processor):
    plain = processor.process(parse_prompt({"messages": MESSAGES, "chat_template": TEMPLATE}))
    greeted = processor.process(parse_prompt({"messages": MESSAGES, "chat_template": TEMPLATE,
                                              "chat_template_kwargs": {"greeting": "Hello"}}))
    assert (plain["prompt"], greeted["prompt"]) == ("[hi][there]", "Hello [hi][there]")
    assert greeted["prompt_token_ids"] == processor.tokenizer.encode("Hello [hi][there]", add_special_tokens=False)
    default = processor.process(parse_prompt({"messages": MESSAGES}))
    assert default["prompt"].startswith("<|im_start|>")  # the model's own template


@pytest.mark.parametrize("prompt, match", [
    ({"prompt": "x", "chat_template": TEMPLATE}, "chat_template applies to chat 'messages' prompts only"),
    ({"messages": MESSAGES, "chat_template_kwargs": {"add_generation_prompt": False}},
     r"chat_template_kwargs may not set \['add_generation_prompt'\]"),
    ({"messages": MESSAGES, "chat_template_kwargs": ["greeting"]}, "chat_template_kwargs must be a dict"),
    ({"messages": MESSAGES, "chat_template": "{% for %}"}, "the chat template failed: TemplateSyntaxError"),
])
def test_bad_template_fields_are_bad_input(processor, prompt, match):
    with pytest.raises(ValueError, match=match):
        processor.process(parse_prompt(prompt))
