"""Kimi K2.5's chat layout with image placeholders, as a Jinja chat template (the source of a
:class:`lockstep.generate.ChatTemplate`; data only: the model package imports nothing from generation).

A released Kimi K2.5 directory ships its own template (``chat_template.jinja``), which
:func:`lockstep.generate.chat.load_chat_template` reads; this one is for directories without it (a tiny test
model, a converted checkpoint) and writes the same turn layout::

    <|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>
    <|im_user|>user<|im_middle|><|media_begin|>image<|media_content|><|media_pad|><|media_end|>Say what.<|im_end|>
    <|im_assistant|>assistant<|im_middle|><think></think>

(no newlines between turns). Each image part (transformers' ``{"type": "image"}`` or OpenAI's
``{"type": "image_url"}``) renders one ``<|media_pad|>`` (transformers' ``Kimi_K25Processor.image_token``,
``config.image_token_id``) between ``<|media_begin|>image<|media_content|>`` and ``<|media_end|>``: the engine
expands it to the image's merged patch count, as the processor does (:mod:`lockstep.generate.vision`). The
generation prompt opens the assistant turn without thinking (``<think></think>``); ``thinking=True`` (a template
variable) leaves ``<think>`` open. A first turn that is not a system turn gets the default system prompt.
Tool calls and videos are not rendered.
"""

from __future__ import annotations

#: the special tokens of the layout; ``<|media_pad|>`` is ``config.image_token_id``, ``<|media_begin|>`` /
#: ``<|media_end|>`` ``vision_start_token_id`` / ``vision_end_token_id``
SPECIAL_TOKENS = ("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>",
                  "<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>")
IMAGE_TOKEN = "<|media_pad|>"
#: the turn that ends a reply (generation stops on it)
END_OF_TURN = "<|im_end|>"
DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."

KIMI_K25_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>" + DEFAULT_SYSTEM + "<|im_end|>"
    "{%- endif -%}"
    "{%- if message['role'] in ('system', 'user', 'assistant') -%}<|im_{{ message['role'] }}|>"
    "{%- else -%}<|im_system|>{%- endif -%}"
    "{{ message['role'] }}<|im_middle|>"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}"
    "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and thinking -%}<think>{%- else -%}<think></think>{%- endif -%}"
    "{%- endif -%}"
)
