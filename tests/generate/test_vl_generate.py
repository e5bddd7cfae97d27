"""Generation with images (issue #24): the engine's greedy tokens for Qwen3-VL requests with images equal
transformers' ``generate``; text-only requests beside image requests; chat templates with image parts
rendered and encoded as transformers' Qwen3-VL processor does; clear errors. Tiny random models, no downloads."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

from lockstep.config.base import ConfigError  # noqa: E402
from lockstep.generate import ChatTemplate, Engine, EngineConfig, Request, SamplingParams  # noqa: E402
from lockstep.generate.chat import message_images  # noqa: E402
from lockstep.generate.vision import PixelImage, expand_placeholders  # noqa: E402
from lockstep.models.hf import load_hf  # noqa: E402

from .conftest import tiny_model  # noqa: E402


def _reference_module():
    """tests/models/qwen3_vl/qwen3_vl_reference.py (the tiny transformers models of the parity tests)."""
    if "qwen3_vl_reference" not in sys.modules:
        path = Path(__file__).parents[1] / "models" / "qwen3_vl" / "qwen3_vl_reference.py"
        spec = importlib.util.spec_from_file_location("qwen3_vl_reference", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["qwen3_vl_reference"] = module
    return sys.modules["qwen3_vl_reference"]


ref = _reference_module()
IMAGE, START, END = ref.IMAGE, ref.START, ref.END
# patch 4, merge 2: sides are rounded to multiples of 8; small pixel bounds keep the images a few tokens
MIN_PIXELS, MAX_PIXELS = 64, 2048
PROCESSOR = dict(patch_size=ref.PATCH, temporal_patch_size=ref.TEMPORAL, merge_size=ref.MERGE,
                 image_mean=[0.5] * 3, image_std=[0.5] * 3)
NEW_TOKENS = 8
#: the engine plumbing (batching, errors, chat, CLI) is the same for both text stacks: the dense model only
DENSE_ONLY = pytest.mark.parametrize("pair", [False], ids=["dense"], indirect=True)


def _images() -> list[np.ndarray]:
    """Three generated RGB images of different sizes: patch grids 4x6, 4x12 and 10x8 (resized to multiples of 8)."""
    gen = np.random.default_rng(0)
    return [gen.integers(0, 256, shape, dtype=np.uint8) for shape in ((18, 27, 3), (12, 44, 3), (40, 30, 3))]


def _hf_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**PROCESSOR, size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})


def _prompt(gen: torch.Generator, n_images: int) -> list[int]:
    """Random text with ``n_images`` images, each as START, one placeholder (expanded by the engine), END."""
    ids = torch.randint(0, START - 10, (4,), generator=gen).tolist()
    for _ in range(n_images):
        ids += [START, IMAGE, END] + torch.randint(0, START - 10, (3,), generator=gen).tolist()
    return ids


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "moe"])
def pair(request, tmp_path_factory):
    """(transformers Qwen3-VL, the lockstep model loaded from its save_pretrained directory)."""
    hf = ref.hf_qwen3_vl(moe=request.param)
    path = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(path)
    return hf, load_hf(path, dtype=torch.float32, allow_unverified=True).eval()


def _requests() -> list[Request]:
    """Two image requests (two images of different sizes; one larger image) and one text-only request."""
    images = _images()
    gen = torch.Generator().manual_seed(1)
    greedy = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS)
    return [Request(prompt_ids=_prompt(gen, 2), images=[PIL.fromarray(images[0]), images[1]], sampling=greedy,
                    request_id="two"),
            Request(prompt_ids=_prompt(gen, 0), sampling=greedy, request_id="text"),
            Request(prompt_ids=_prompt(gen, 1), images=[images[2]], sampling=greedy, request_id="one")]


def _engine(model, **config) -> Engine:
    config = dict(dict(cache_memory_mb=4, block_size=4, max_batch_size=4, image_min_pixels=MIN_PIXELS,
                       image_max_pixels=MAX_PIXELS), **config)
    return Engine(model, None, EngineConfig(**config))


def _hf_generate(hf, request: Request) -> list[int]:
    """transformers' greedy ``generate`` of one request, its images through transformers' processor."""
    kwargs = {}
    prompt = request.prompt_ids
    if request.images:
        processed = _hf_processor()(images=[np.asarray(i) for i in request.images], return_tensors="pt")
        grid = processed["image_grid_thw"]
        prompt = expand_placeholders(prompt, (grid.prod(-1) // ref.MERGE ** 2).tolist(), IMAGE)
    tokens = torch.tensor([prompt])
    if request.images:
        kwargs = dict(pixel_values=processed["pixel_values"], image_grid_thw=grid,
                      mm_token_type_ids=(tokens == IMAGE).int())
    hf.model.rope_deltas = None  # transformers caches rope deltas between calls
    out = hf.generate(input_ids=tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=NEW_TOKENS,
                      do_sample=False, pad_token_id=0, **kwargs)
    return out[0, tokens.shape[1]:].tolist()


@pytest.fixture(scope="module")
def hf_tokens(pair) -> list[list[int]]:
    """transformers' greedy tokens of each of :func:`_requests`, one request at a time."""
    return [_hf_generate(pair[0], request) for request in _requests()]


@pytest.mark.parametrize("prefill_chunk", [0, 8], ids=["one_shot", "chunk8"])
def test_greedy_tokens_equal_transformers_generate(pair, hf_tokens, prefill_chunk):
    """Image and text-only requests batched together (continuous batching, one prefill); with 8-token
    chunks the images straddle chunk boundaries. Greedy tokens: equal, token for token."""
    _, model = pair
    requests = _requests()
    results = _engine(model, prefill_chunk=prefill_chunk).generate(requests)
    for request, result, expected in zip(requests, results, hf_tokens):
        assert result.token_ids == expected, (request.request_id, result.token_ids, expected)
    counts = [[6, 12], [], [20]]  # merged patches: 4x6/4, 4x12/4, 10x8/4
    for result, request, n in zip(results, requests, counts):
        assert result.prompt_ids.count(IMAGE) == sum(n)  # the prompt came back expanded
        assert len(result.prompt_ids) == len(request.prompt_ids) + sum(n) - len(n)


@DENSE_ONLY
def test_text_request_unchanged_beside_image_requests(pair):
    """A text-only request alone and batched with two image requests: the same tokens, and (batch-invariant
    mode: a row's arithmetic does not depend on its batch) bitwise the same logits; so too an image request."""
    _, model = pair
    requests = _requests()

    def run(batch: list[Request]) -> dict[str, tuple[list[int], list[torch.Tensor]]]:
        engine = _engine(model, batch_invariant=True)
        seen: dict[int, list[torch.Tensor]] = {}
        engine.on_logits = lambda ids, logits: [seen.setdefault(i, []).append(logits[r].clone())
                                                for r, i in enumerate(ids)]
        results = engine.generate(batch)
        return {r.request_id: (r.token_ids, seen[k]) for k, r in enumerate(results)}

    together = run(requests)
    for alone in (run([requests[1]]), run([requests[2]])):
        [(name, (tokens, logits))] = alone.items()
        assert tokens == together[name][0]
        assert all(torch.equal(a, b) for a, b in zip(logits, together[name][1], strict=True)), name


@DENSE_ONLY
def test_preprocessed_pixels_equal_raw_images(pair):
    """A PixelImage (transformers' processor output) gives the same tokens as the raw image."""
    _, model = pair
    request = _requests()[2]
    processed = _hf_processor()(images=[request.images[0]], return_tensors="pt")
    pixel = PixelImage(processed["pixel_values"], tuple(processed["image_grid_thw"][0].tolist()))
    pre = Request(prompt_ids=request.prompt_ids, images=[pixel], sampling=request.sampling)
    raw, given = _engine(model).generate([request, pre])
    assert raw.token_ids == given.token_ids and raw.prompt_ids == given.prompt_ids


@DENSE_ONLY
def test_image_request_errors(pair):
    _, model = pair
    engine = _engine(model)
    image = _images()[0]
    gen = torch.Generator().manual_seed(2)
    with pytest.raises(ConfigError, match=r"Request.images: 2 image\(s\) given, but the prompt has 1"):
        engine.add_request(Request(prompt_ids=_prompt(gen, 1), images=[image, image]))
    with pytest.raises(ConfigError, match="Request.prompt_ids: the prompt holds image placeholders"):
        engine.add_request(Request(prompt_ids=_prompt(gen, 1)))
    with pytest.raises(ConfigError, match="Request.prompt_ids: image 0 has 2 placeholder tokens; give 1"):
        engine.add_request(Request(prompt_ids=[1, START, IMAGE, IMAGE, END], images=[image]))
    with pytest.raises(ConfigError, match=r"Request.images\[0\]"):
        engine.add_request(Request(prompt_ids=_prompt(gen, 1), images=[np.zeros((8, 8, 3), np.float32)]))
    with pytest.raises(ConfigError, match=r"Request.images\[0\].pixel_values: shape"):
        engine.add_request(Request(prompt_ids=_prompt(gen, 1), images=[PixelImage(torch.zeros(4, 3), (1, 2, 2))]))
    with pytest.raises(ConfigError, match=r"Request.images: the model \(llama3\) has no vision tower"):
        _engine(tiny_model("llama3")).add_request(Request(prompt_ids=[1, 2], images=[image]))


# ----------------------------------------------------------------------------------------- chat templates

#: a Qwen-VL style chat template (string or list content; image parts render vision_start, image_pad, vision_end)
VL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = {"<|im_start|>": 240, "<|im_end|>": 241, "<|vision_start|>": START, "<|vision_end|>": END,
            "<|image_pad|>": IMAGE, "<|video_pad|>": ref.VIDEO}


def _tokenizer():
    """A transformers fast tokenizer over the tiny vocabulary: bytes-ish characters + Qwen's special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(32 + i): i for i in range(95)} | {"\n": 95} | dict(SPECIALS)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    fast.add_special_tokens({"additional_special_tokens": list(SPECIALS)})
    return fast


def _processor(tokenizer):
    """transformers' Qwen3-VL processor (the PIL image processor of these models, the VL template)."""
    from transformers import Qwen3VLProcessor

    class ImageOnlyProcessor(Qwen3VLProcessor):
        """Qwen3-VL's processor without a video processor: transformers' class check of that argument
        needs torchvision (not installed here); images never reach it."""

        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name != "video_processor":
                return super().check_argument_for_proper_class(argument_name, argument)

    return ImageOnlyProcessor(image_processor=_hf_processor(), tokenizer=tokenizer, video_processor=None,
                              chat_template=VL_TEMPLATE)


@DENSE_ONLY
def test_chat_template_with_images_equals_transformers_processor(pair):
    """Messages with image parts (transformers' ``{"type": "image"}`` and OpenAI's ``image_url``) render the
    processor's text, and the engine's expanded prompt equals the processor's input_ids; then generate."""
    hf, model = pair
    images = [PIL.fromarray(i) for i in _images()[:2]]
    tokenizer = _tokenizer()
    processor = _processor(tokenizer)
    messages = [{"role": "user", "content": [
        {"type": "image", "image": images[0]}, {"type": "text", "text": "Say what."},
        {"type": "image", "image": images[1]}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    template = ChatTemplate(VL_TEMPLATE)
    assert template.render(messages) == text
    expected = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=True, return_tensors="pt")
    openai = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": images[0]}}, {"type": "text", "text": "Say what."},
        {"type": "image_url", "image_url": {"url": images[1]}}]}]
    for chat in (messages, openai):
        assert message_images(chat) == images
        request = Request(prompt_ids=template.encode(tokenizer, chat), images=message_images(chat),
                          sampling=SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS))
        [result] = _engine(model).generate([request])
        assert result.prompt_ids == expected["input_ids"][0].tolist()
    hf.model.rope_deltas = None
    out = hf.generate(**expected, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    assert result.token_ids == out[0, expected["input_ids"].shape[1]:].tolist()


@DENSE_ONLY
def test_cli_generate_with_image(pair, tmp_path, capsys):
    """``lockstep generate --chat --image PATH --json`` on a model directory (tokenizer with the template,
    preprocessor_config.json's pixel bounds): the prompt and tokens of transformers' processor + generate."""
    import json

    from lockstep.cli_generate import cmd_generate

    hf, _ = pair
    hf.save_pretrained(tmp_path)
    tokenizer = _tokenizer()
    tokenizer.chat_template = VL_TEMPLATE
    tokenizer.save_pretrained(tmp_path)
    _hf_processor().save_pretrained(tmp_path)
    image = PIL.fromarray(_images()[2])
    image.save(tmp_path / "image.png")
    assert cmd_generate(["--checkpoint", str(tmp_path), "--allow-unverified-weights", "--chat", "--prompt", "Say.",
                         "--image", str(tmp_path / "image.png"), "--max-new-tokens", str(NEW_TOKENS),
                         "--ignore-eos", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Say."}]}]
    expected = _processor(tokenizer).apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                         return_dict=True, return_tensors="pt")
    assert result["prompt_ids"] == expected["input_ids"][0].tolist()
    hf.model.rope_deltas = None
    out = hf.generate(**expected, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert result["token_ids"] == out[0, expected["input_ids"].shape[1]:].tolist()
    with pytest.raises(ConfigError, match="--image: needs --chat"):
        cmd_generate(["--checkpoint", str(tmp_path), "--prompt", "x", "--image", str(tmp_path / "image.png")])


def test_message_images_sources_and_errors(tmp_path):
    """Image parts by value, local path, file:// and data: URL load the same pixels; web URLs and broken parts
    are ConfigErrors naming the part."""
    import base64
    import io

    array = _images()[0]
    PIL.fromarray(array).save(tmp_path / "a.png")
    encoded = io.BytesIO()
    PIL.fromarray(array).save(encoded, format="PNG")
    data_url = "data:image/png;base64," + base64.b64encode(encoded.getvalue()).decode()
    parts = [{"type": "image", "image": array}, {"type": "image", "path": str(tmp_path / "a.png")},
             {"type": "image_url", "image_url": {"url": f"file://{tmp_path / 'a.png'}"}},
             {"type": "image_url", "image_url": data_url}, {"type": "text", "text": "hi"}]
    images = message_images([{"role": "system", "content": "s"}, {"role": "user", "content": parts}])
    assert len(images) == 4 and all(np.array_equal(np.asarray(i), array) for i in images)
    with pytest.raises(ConfigError, match=r"messages\[0\].content\[0\]: .* is a web URL; images are not downloaded"):
        message_images([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/a.png"}}]}])
    with pytest.raises(ConfigError, match=r"messages\[0\].content\[1\]: an image part without its image"):
        message_images([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}]}])
    with pytest.raises(ConfigError, match=r"messages\[0\].content\[0\]: cannot read the image"):
        message_images([{"role": "user", "content": [{"type": "image", "path": str(tmp_path / "missing.png")}]}])
    with pytest.raises(ConfigError, match=r"messages\[0\].content: must be a string or a list of parts"):
        message_images([{"role": "user", "content": 3}])
    # data: URLs: junk in the base64, a truncated image and a decompression bomb name the part too
    for url in [data_url[:40] + "!!" + data_url[40:], data_url[:len(data_url) // 2 // 4 * 4]]:
        with pytest.raises(ConfigError, match=r"messages\[0\].content\[0\]: cannot read the image"):
            message_images([{"role": "user", "content": [{"type": "image_url", "image_url": url}]}])
    assert np.array_equal(np.asarray(message_images([{"role": "user", "content": [
        {"type": "image_url", "image_url": data_url[:50] + "\n" + data_url[50:]}]}])[0]), array)  # wrapped lines
    bomb_limit = PIL.MAX_IMAGE_PIXELS
    try:
        PIL.MAX_IMAGE_PIXELS = array.shape[0] * array.shape[1] // 4  # > 2x the limit: PIL's DecompressionBombError
        with pytest.raises(ConfigError, match=r"messages\[0\].content\[0\]: cannot read the image .*decompression"):
            message_images([{"role": "user", "content": [{"type": "image_url", "image_url": data_url}]}])
    finally:
        PIL.MAX_IMAGE_PIXELS = bomb_limit
    with pytest.raises(ConfigError, match=r"messages\[0\].content\[0\]: must be a dict with a 'type'"):
        ChatTemplate(VL_TEMPLATE).render([{"role": "user", "content": ["text"]}])
