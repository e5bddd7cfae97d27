"""Generation with images for Kimi K2.5 (issue #24): raw images go through lockstep's Kimi preprocessing
(lockstep.models.kimi_k25.images) in the engine; greedy tokens equal transformers' Kimi K2.5 ``generate`` fed the
same pixel values (transformers' Kimi image processor needs torchvision, which is not installed: docs/vision.md);
Kimi's chat template with image placeholders, rendered and expanded as transformers' ``Kimi_K25Processor`` does;
``lockstep generate --chat --image`` on a Kimi K2.5 model directory. Tiny random models, no downloads."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

from lockstep.generate import ChatTemplate, Engine, EngineConfig, Request, SamplingParams  # noqa: E402
from lockstep.generate.chat import message_images  # noqa: E402
from lockstep.generate.vision import PixelImage, expand_placeholders  # noqa: E402
from lockstep.models.hf import load_hf  # noqa: E402
from lockstep.models.kimi_k25.chat import END_OF_TURN, KIMI_K25_CHAT_TEMPLATE, SPECIAL_TOKENS  # noqa: E402
from lockstep.models.kimi_k25.images import KimiImageProcessorConfig, preprocess_images  # noqa: E402


def _reference_module():
    """tests/models/kimi_k25/kimi_k25_reference.py (the tiny transformers model of the parity tests)."""
    if "kimi_k25_reference" not in sys.modules:
        folder = Path(__file__).parents[1] / "models" / "kimi_k25"
        spec = importlib.util.spec_from_file_location("kimi_k25_reference", folder / "kimi_k25_reference.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["kimi_k25_reference"] = module
    return sys.modules["kimi_k25_reference"]


ref = _reference_module()
IMAGE, START, END, PATCH, MERGE = ref.IMAGE, ref.START, ref.END, ref.PATCH, ref.MERGE
#: the tiny model's processor: transformers' defaults with its 4-pixel patches (the engine builds the same)
PROCESSOR = KimiImageProcessorConfig(patch_size=PATCH, merge_size=MERGE)
NEW_TOKENS = 8
#: Kimi's chat tokens in the tiny vocabulary (media_pad / begin / end are the config's image / start / end ids)
SPECIALS = dict(zip(SPECIAL_TOKENS, [240, 241, 242, 243, 244, START, 245, IMAGE, END]))
TEMPLATE = ChatTemplate(KIMI_K25_CHAT_TEMPLATE, {"eos_token": END_OF_TURN})


def _images() -> list[np.ndarray]:
    """Three generated RGB images: padded (never resized) to 24x32, 16x48 and 40x32 -> 12, 12 and 20 tokens."""
    gen = np.random.default_rng(0)
    return [gen.integers(0, 256, shape, dtype=np.uint8) for shape in ((18, 27, 3), (12, 44, 3), (40, 30, 3))]


def _prompt(gen: torch.Generator, n_images: int) -> list[int]:
    ids = torch.randint(0, 240, (4,), generator=gen).tolist()
    for _ in range(n_images):
        ids += [START, IMAGE, END] + torch.randint(0, 240, (3,), generator=gen).tolist()
    return ids


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers Kimi K2.5, the lockstep model loaded from its save_pretrained directory, that directory)."""
    hf = ref.hf_kimi_k25()
    path = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(path)
    return hf, load_hf(path, dtype=torch.float32, allow_unverified=True).eval(), path


def _requests() -> list[Request]:
    """Two images of different sizes (a PIL image and an array) in one request, and a text-only request."""
    images = _images()
    gen = torch.Generator().manual_seed(1)
    greedy = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS)
    return [Request(prompt_ids=_prompt(gen, 2), images=[PIL.fromarray(images[0]), images[1]], sampling=greedy),
            Request(prompt_ids=_prompt(gen, 0), sampling=greedy)]


def _engine(model, **config) -> Engine:
    return Engine(model, None, EngineConfig(**dict(dict(cache_memory_mb=4, block_size=4, max_batch_size=4), **config)))


def _hf_pixels(images) -> dict[str, torch.Tensor]:
    """transformers' model inputs of ``images``: lockstep's pixel values as ``[P, C, p, p]`` patches."""
    processed = preprocess_images([np.asarray(i) for i in images], PROCESSOR)
    return {"pixel_values": torch.from_numpy(processed.pixel_values).view(-1, 3, PATCH, PATCH),
            "image_grid_thw": torch.from_numpy(processed.grid_thw)}


def _hf_generate(hf, prompt: list[int], images) -> list[int]:
    """transformers' greedy ``generate`` of one prompt (its placeholders expanded) with its images."""
    kwargs = _hf_pixels(images) if images else {}
    if images:
        prompt = expand_placeholders(prompt, (kwargs["image_grid_thw"].prod(-1) // MERGE ** 2).tolist(), IMAGE)
    tokens = torch.tensor([prompt])
    out = hf.generate(input_ids=tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=NEW_TOKENS,
                      do_sample=False, pad_token_id=0, eos_token_id=None, **kwargs)
    return out[0, tokens.shape[1]:].tolist()


def test_raw_images_greedy_equals_transformers_generate(pair):
    """Image and text-only requests batched (one prefill; then 8-token chunks, images straddling them):
    greedy tokens == transformers' generate, token for token; a PixelImage of the same pixels beside a raw image
    == both raw."""
    hf, model, _ = pair
    requests = _requests()
    expected = [_hf_generate(hf, r.prompt_ids, r.images) for r in requests]
    for chunk in (0, 8):
        results = _engine(model, prefill_chunk=chunk).generate(requests)
        for k, (result, want) in enumerate(zip(results, expected)):
            assert result.token_ids == want, (chunk, k, result.token_ids, want)
    for result, request, counts in zip(results, requests, [[12, 12], []]):
        assert result.prompt_ids.count(IMAGE) == sum(counts)
        assert len(result.prompt_ids) == len(request.prompt_ids) + sum(counts) - len(counts)
    pixels = _hf_pixels(requests[0].images[:1])
    given = PixelImage(pixels["pixel_values"].flatten(1), tuple(pixels["image_grid_thw"][0].tolist()))
    [pre] = _engine(model).generate([Request(prompt_ids=requests[0].prompt_ids, images=[given, requests[0].images[1]],
                                             sampling=requests[0].sampling)])
    assert pre.token_ids == results[0].token_ids and pre.prompt_ids == results[0].prompt_ids


# ----------------------------------------------------------------------------------------- chat template

def _tokenizer(template: str | None = None):
    """A transformers fast tokenizer over the tiny vocabulary: characters + Kimi's chat and media tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(32 + i): i for i in range(95)} | {"\n": 95} | SPECIALS
    tok = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    fast.add_special_tokens({"additional_special_tokens": list(SPECIALS)})
    fast.chat_template = template
    return fast


def _processor(tokenizer):
    """transformers' ``Kimi_K25Processor`` (its chat template rendering and ``<|media_pad|>`` expansion) over an
    image processor that returns lockstep's pixel values: transformers' own Kimi image processor imports
    torchvision, which is not installed (the video processor likewise: images never reach it)."""
    from transformers import BatchFeature, Kimi_K25Processor
    from transformers.image_utils import make_flat_list_of_images
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    class LockstepPixels(Qwen2VLImageProcessorPil):  # a transformers image processor class, for the type checks
        def __call__(self, images, **kwargs):
            return BatchFeature(_hf_pixels(make_flat_list_of_images(images)))

    class ImageOnlyProcessor(Kimi_K25Processor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name != "video_processor":
                return super().check_argument_for_proper_class(argument_name, argument)

    return ImageOnlyProcessor(image_processor=LockstepPixels(merge_size=MERGE), tokenizer=tokenizer,
                              video_processor=None, chat_template=KIMI_K25_CHAT_TEMPLATE)


def test_chat_template_with_images_equals_transformers_processor(pair):
    """The template renders Kimi's layout (as transformers renders it); the engine's expanded prompt of the
    encoded messages (transformers' and OpenAI's image parts) == Kimi_K25Processor's input_ids; then generate."""
    hf, model, _ = pair
    images = [PIL.fromarray(i) for i in _images()[:2]]
    tokenizer = _tokenizer(KIMI_K25_CHAT_TEMPLATE)
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": [
        {"type": "image", "image": images[0]}, {"type": "text", "text": "Say what."},
        {"type": "image", "image": images[1]}]}]
    media = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
    text = TEMPLATE.render(messages)
    assert text == ("<|im_system|>system<|im_middle|>S<|im_end|>"
                    f"<|im_user|>user<|im_middle|>{media}Say what.{media}<|im_end|>"
                    "<|im_assistant|>assistant<|im_middle|><think></think>")
    assert text == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    thinking = TEMPLATE.render(messages, thinking=True)
    assert thinking == text[:-len("</think>")]
    expected = _processor(tokenizer).apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                         return_dict=True, return_tensors="pt")
    openai = [messages[0], {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": images[0]}}, {"type": "text", "text": "Say what."},
        {"type": "image_url", "image_url": {"url": images[1]}}]}]
    prompt = TEMPLATE.encode(tokenizer, messages)
    assert message_images(messages) == message_images(openai) == images
    assert TEMPLATE.encode(tokenizer, openai) == prompt
    request = Request(prompt_ids=prompt, images=message_images(messages),
                      sampling=SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS))
    [result] = _engine(model).generate([request])
    assert result.prompt_ids == expected["input_ids"][0].tolist()
    out = hf.generate(**expected, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert result.token_ids == out[0, expected["input_ids"].shape[1]:].tolist()


def test_cli_generate_with_image(pair, tmp_path, capsys):
    """``lockstep generate --chat --image PATH --json`` on a Kimi K2.5 model directory (transformers' files, a
    tokenizer with the template): the prompt of Kimi_K25Processor and the tokens of transformers' generate."""
    from lockstep.cli_generate import cmd_generate

    hf, _, hf_dir = pair
    for file in hf_dir.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    tokenizer = _tokenizer(KIMI_K25_CHAT_TEMPLATE)
    tokenizer.save_pretrained(tmp_path)
    image = PIL.fromarray(_images()[2])
    image.save(tmp_path / "image.png")
    assert cmd_generate(["--checkpoint", str(tmp_path), "--allow-unverified-weights", "--chat", "--system", "S",
                         "--prompt", "Say.",
                         "--image", str(tmp_path / "image.png"), "--max-new-tokens", str(NEW_TOKENS),
                         "--ignore-eos", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    messages = [{"role": "system", "content": "S"},
                {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Say."}]}]
    expected = _processor(tokenizer).apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                         return_dict=True, return_tensors="pt")
    assert result["prompt_ids"] == expected["input_ids"][0].tolist()
    assert result["prompt_ids"].count(IMAGE) == 20
    out = hf.generate(**expected, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert result["token_ids"] == out[0, expected["input_ids"].shape[1]:].tolist()


def test_template_turns_and_default_system_prompt():
    """String contents, an assistant turn, and the default system prompt when the first turn is not a system one."""
    template = ChatTemplate(KIMI_K25_CHAT_TEMPLATE)
    text = template.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                           add_generation_prompt=False)
    assert text == ("<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
                    "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>yo<|im_end|>")
