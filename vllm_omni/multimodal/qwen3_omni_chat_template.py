"""The Qwen3-Omni chat template (the structure of the released checkpoints' template, no tools).

Differences from Qwen2.5-Omni's that change the prompt: no default system prompt, the Qwen3
placeholder tokens (<|audio_start|><|audio_pad|><|audio_end|>, <|vision_start|><|image_pad|>
<|vision_end|>, <|vision_start|><|video_pad|><|vision_end|>), and an assistant turn's
`<think>...</think>` block is dropped from the history, as the released template does.
`enable_thinking=False` opens the reply with an empty think block (the Thinking variant's switch).
"""

from __future__ import annotations

# Same part conditions as the released template: a part is an image if its type is "image" or
# it has an "image"/"image_url" key, and so on; parts are normalized first (chat_parts.py).
QWEN3_OMNI_CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif part['type'] == 'audio' or 'audio' in part or 'audio_url' in part -%}"
    "<|audio_start|><|audio_pad|><|audio_end|>"
    "{%- elif part['type'] == 'video' or 'video' in part -%}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif 'text' in part -%}{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for message in messages -%}"
    "{%- set content = render(message['content']) -%}"
    "{%- if message['role'] == 'assistant' and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)
