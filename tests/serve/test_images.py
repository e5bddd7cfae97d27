"""``lockstep serve`` with image inputs (issues #24/#22): OpenAI chat ``image_url`` parts, through the official
``openai`` client, against a tiny random Qwen3-VL model directory (tokenizer with a VL chat template,
``preprocessor_config.json``) loaded as ``lockstep serve`` loads it. Image answers equal the lockstep Engine's
for the same images and messages (greedy, token for token), streaming equals not streaming, image and
text-only requests batch together (batch-invariant mode on both sides, so batching changes no token), and
every refusal is a 400 naming the part's field."""

from __future__ import annotations

import base64
import concurrent.futures
import io
import json
import types
import urllib.request

import numpy as np
import openai
import pytest
from PIL import Image

from lockstep.generate import Engine, EngineConfig, Request, SamplingParams
from lockstep.generate.chat import message_images
from lockstep.generate.vision import image_pixel_bounds
from lockstep.load import load_model
from lockstep.serve import BackgroundServer, create_app
from lockstep.serve.cli import build_engine
from lockstep.serve.images import ImageLimits, image_refusal, load_images
from lockstep.serve.protocol import ApiError
from tests.generate.test_vl_generate import MAX_PIXELS, MIN_PIXELS, VL_TEMPLATE, _hf_processor, _tokenizer, ref

MODEL = "tiny-vl"
#: engine configuration of the server and of the reference engine (batch-invariant: a row's tokens do not
#: depend on what else is in the batch, so concurrent requests can be compared token for token)
ENGINE = dict(cache_memory_mb=8, block_size=4, max_batch_size=4, batch_invariant=True)
LIMITS = dict(max_images=3, max_pixels=64 * 64)
NEW = 6


def make_vl_dir(path) -> None:
    """transformers' tiny Qwen3-VL saved with a tokenizer (VL chat template) and its image processor."""
    ref.hf_qwen3_vl(moe=False).save_pretrained(path)
    tokenizer = _tokenizer()
    tokenizer.chat_template = VL_TEMPLATE
    tokenizer.save_pretrained(path)
    _hf_processor().save_pretrained(path)


def images() -> list[np.ndarray]:
    gen = np.random.default_rng(3)
    return [gen.integers(0, 256, shape, dtype=np.uint8) for shape in ((18, 27, 3), (40, 30, 3), (16, 16, 3))]


def encoded(array: np.ndarray, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).save(out, format=fmt)
    return out.getvalue()


def data_url(raw: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(raw).decode()


def part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def user(*parts, text: str = "Say what.") -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def vl_dir(computed_once):
    return computed_once("serve-tiny-qwen3-vl", make_vl_dir)


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("allowed")
    (folder / "a.png").write_bytes(encoded(images()[0]))
    outside = folder.parent / f"{folder.name}-outside"  # reached as {dir}/../{name}-outside
    outside.mkdir()
    (outside / "b.png").write_bytes(encoded(images()[1]))
    (folder / "link.png").symlink_to(outside / "b.png")  # inside by name, outside once resolved
    return folder


def load(vl_dir):
    source = load_model(vl_dir, dtype="float32", allow_unverified=True)
    source.model.eval()
    return source


@pytest.fixture(scope="module")
def reference(vl_dir):
    source = load(vl_dir)
    return Engine(source.model, source.tokenizer, EngineConfig(**ENGINE, **image_pixel_bounds(vl_dir))), source


@pytest.fixture(scope="module")
def served(vl_dir, image_dir):
    source = load(vl_dir)
    # lockstep serve's engine takes its pixel bounds from the model directory, as the reference does
    built = build_engine("lockstep", source.model, source.tokenizer, cache_mb=1, max_batch_size=1,
                         model_dir=source.path)
    assert (built.config.image_min_pixels, built.config.image_max_pixels) == (MIN_PIXELS, MAX_PIXELS)
    engine = Engine(source.model, source.tokenizer, EngineConfig(**ENGINE, **image_pixel_bounds(source.path)))
    app = create_app(engine, model_name=MODEL, chat_template=source.chat_template, stop_token_ids=source.stop_token_ids,
                     max_batch_size=4, max_queue=8, image_limits=ImageLimits(**LIMITS, allowed_dir=image_dir))
    with BackgroundServer(app) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield server, client


def engine_run(reference, messages: list[dict], pixels: list) -> object:
    """The reference engine's greedy answer: the messages with the images themselves (no URLs)."""
    engine, source = reference
    chat = [{**m, "content": [{"type": "image", "image": pixels.pop(0)} if p["type"] == "image_url" else p
                              for p in m["content"]]} for m in messages]
    request = Request(prompt_ids=source.chat_template.encode(source.tokenizer, chat), images=message_images(chat),
                      sampling=SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True))
    [result] = engine.generate([request])
    return result


def ask(client, messages, **extra):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW, temperature=0,
                                          extra_body={"return_token_ids": True, "ignore_eos": True}, **extra)


def test_image_chat_is_the_engine_streamed_or_not(served, reference):
    """Two PNG images and text: the engine's prompt (placeholders expanded), tokens and text; a stream
    concatenates to the same text and token ids."""
    _, client = served
    arrays = images()
    messages = user(part(data_url(encoded(arrays[0]))), part(data_url(encoded(arrays[1]))))
    want = engine_run(reference, messages, [arrays[0], arrays[1]])
    out = ask(client, messages)
    assert out.choices[0].token_ids == want.token_ids and len(want.token_ids) == NEW
    assert out.prompt_token_ids == want.prompt_ids and want.prompt_ids.count(ref.IMAGE) == 6 + 20
    assert out.choices[0].message.content == want.text
    assert out.usage.prompt_tokens == len(want.prompt_ids)
    chunks = list(ask(client, messages, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert [t for c in chunks for t in (getattr(c.choices[0], "token_ids", None) or [])] == want.token_ids
    assert chunks[-1].choices[0].finish_reason == "length"


def test_jpeg_webp_and_allowed_files(served, reference, image_dir):
    """A JPEG and a WebP data URL and a file:// URL inside --allowed-image-dir (a PNG) in one message: the
    engine's answer for the decoded pixels of the same bytes."""
    _, client = served
    arrays = images()
    raws = [encoded(arrays[1], "JPEG"), encoded(arrays[2], "WEBP")]
    decoded = [np.asarray(Image.open(io.BytesIO(raw)).convert("RGB")) for raw in raws]
    assert not any(np.array_equal(d, a) for d, a in zip(decoded, arrays[1:]))  # lossy: the same bytes matter
    messages = user(part(data_url(raws[0], "image/jpeg")), part(data_url(raws[1], "image/webp")),
                    part(f"file://{image_dir / 'a.png'}"))
    want = engine_run(reference, messages, [*decoded, arrays[0]])
    out = ask(client, messages)
    assert out.choices[0].token_ids == want.token_ids and out.prompt_token_ids == want.prompt_ids


def test_image_and_text_requests_batch_together(served, reference):
    """Three concurrent clients, two with images and one text-only, run in shared engine steps; each answer
    is the one the engine gives it alone (batch-invariant mode)."""
    server, client = served
    arrays = images()
    cases = [(user(part(data_url(encoded(arrays[0])))), [arrays[0]]), (user(text="Only text."), []),
             (user(part(data_url(encoded(arrays[2]))), text="Two."), [arrays[2]])]
    wants = []
    for messages, pixels in cases:
        if pixels:
            wants.append(engine_run(reference, messages, list(pixels)).token_ids)
        else:
            engine, source = reference
            [result] = engine.generate([Request(prompt_ids=source.chat_template.encode(source.tokenizer, messages),
                                                sampling=SamplingParams(temperature=0, max_new_tokens=NEW,
                                                                        ignore_eos=True))])
            wants.append(result.token_ids)
    before = json.loads(urllib.request.urlopen(server.base_url + "/stats").read())
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda case: ask(client, case[0]), cases))
    after = json.loads(urllib.request.urlopen(server.base_url + "/stats").read())
    assert [o.choices[0].token_ids for o in outs] == wants
    assert after["batched_steps"] > before["batched_steps"] and after["in_flight"] == 0


def _truncated_png() -> str:
    raw = encoded(images()[1])
    return data_url(raw[: len(raw) // 2])


BMP = data_url(encoded(images()[2], "BMP"), "image/bmp")
BIG = data_url(encoded(np.zeros((65, 64, 3), np.uint8)))  # one row over LIMITS' 64 x 64 pixels
PNG = data_url(encoded(images()[2]))
FIELD = "messages[0].content[0].image_url.url"


@pytest.mark.parametrize("content, field, message", [
    ([part("data:image/png;base64,iVBOR!!w0KGgo=")], FIELD, "not valid base64"),
    ([part(data_url(b"plain text, not an image"))], FIELD, "not an image in a supported format"),
    ([part(BMP)], FIELD, "not an image in a supported format (PNG, JPEG, WEBP, GIF)"),
    ([part(_truncated_png())], FIELD, "the image cannot be decoded"),
    ([part("data:text/plain;base64,aGk=")], FIELD, "a data URL must be data:image/<type>;base64"),
    ([part("https://example.com/a.png")], FIELD, "this server does no network fetches"),
    ([part("/etc/hostname")], FIELD, "an image URL must be a data:image/...;base64 URL"),
    ([part("file:///etc/hostname")], FIELD, "no image file '/etc/hostname' inside the allowed image directory"),
    ([part("file://{dir}/link.png")], FIELD, "inside the allowed image directory"),
    ([part("file://{dir}/a.png%00.png")], FIELD, "inside the allowed image directory"),
    ([part("file://{dir}/../{name}-outside/b.png")], FIELD, "inside the allowed image directory"),
    ([part(BIG)], FIELD, "the image is 64x65 = 4160 pixels; this server takes at most 4096 per image"),
    ([part(PNG)] * 4, "messages", "more than 3 images in one request"),
    ([{"type": "image_url"}], "messages[0].content[0].image_url", "an image_url part needs image_url.url"),
    ([{"type": "input_audio"}], "messages[0].content[0]", "only text and image_url parts are supported"),
])
def test_bad_image_parts_are_400s_naming_the_field(served, image_dir, content, field, message):
    _, client = served
    content = json.loads(json.dumps(content).replace("{dir}", str(image_dir)).replace("{name}", image_dir.name))
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=2)
    error = caught.value.body
    assert error["param"] == field and error["message"].startswith(field + ":"), error
    assert message in error["message"], error


def test_image_in_an_assistant_message_and_placeholders_without_images(served):
    _, client = served
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [part(PNG)]},
                {"role": "user", "content": "and?"}]
    with pytest.raises(openai.BadRequestError, match=r"messages\[1\].content\[0\]: image parts are taken in user"):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    # the placeholder typed as text, with no image: the engine refuses the prompt (a 400, the server lives on)
    with pytest.raises(openai.BadRequestError, match="the prompt holds image placeholders"):
        client.chat.completions.create(model=MODEL, max_tokens=2,
                                       messages=[{"role": "user", "content": "<|vision_start|><|image_pad|>"}])
    assert ask(client, user(part(PNG))).choices[0].finish_reason == "length"


def test_file_urls_need_an_allowed_directory(image_dir):
    """Without --allowed-image-dir no file:// URL is read, even one that exists."""
    with pytest.raises(ApiError, match=r"file:// URLs are refused: the server was started without "
                                       r"--allowed-image-dir") as caught:
        load_images(user(part(f"file://{image_dir / 'a.png'}")), ImageLimits())
    assert caught.value.param == "messages[0].content[0].image_url.url"


def test_an_engine_without_vision_refuses_images_of_a_vision_model(reference):
    """An engine without ``vision`` (VllmEngine: it hands vLLM text only) over a vision-language model: the
    400 points at --engine lockstep (tests/serve/test_vllm_serve.py: the same refusal over vLLM, text model)."""
    engine, _ = reference
    assert image_refusal(engine) is None
    assert image_refusal(types.SimpleNamespace(model=engine.model)).endswith(
        "although the model (qwen3_vl) has a vision tower; serve it with --engine lockstep for images")
