"""Chat prompts: a tokenizer's own Jinja chat template, rendered in a sandbox.

Hugging Face tokenizers ship their chat template in ``tokenizer_config.json`` (``chat_template``: a
string, or a list of ``{"name", "template"}`` with a ``"default"`` one) or beside it in
``chat_template.jinja``. :func:`load_chat_template` reads it (``None`` when the model has none);
:meth:`ChatTemplate.render` turns a list of ``{"role", "content"}`` messages into the prompt text
and :meth:`ChatTemplate.encode` into the token ids to put in ``Request.prompt_ids``.

A message's ``content`` is a string or a list of parts (``{"type": "text", "text": ...}``, image parts:
``{"type": "image", ...}`` / OpenAI's ``{"type": "image_url", ...}``), which the template renders (Qwen3-VL's
writes ``<|vision_start|><|image_pad|><|vision_end|>`` per image); :func:`message_images` collects the images
for ``Request.images``, and the engine expands each image's one placeholder to its merged patch count, as
transformers' processor does (:mod:`lockstep.generate.vision`).

Rendering follows ``transformers``' ``apply_chat_template`` so a prompt is the one the model was
tuned on: an ``ImmutableSandboxedEnvironment`` (the template is data from a model download, not
trusted code) with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a
``tojson`` filter that does not HTML-escape, the ``raise_exception`` and ``strftime_now`` globals,
the tokenizer's special tokens (``bos_token``, ``eos_token``, ...) as variables, and a
``{% generation %}`` block that just renders its body. The rendered text is encoded without adding
special tokens (the template already wrote them), as transformers does.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from lockstep.config.base import ConfigError

#: where a tokenizer directory keeps its template
TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
#: tokenizer_config.json entries passed to the template as variables
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template and the special tokens it may refer to."""

    #: the Jinja source
    source: str
    #: ``bos_token``, ``eos_token``, ... as strings (variables of the template)
    special_tokens: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               **variables: Any) -> str:
        """The prompt text of ``messages``; ``add_generation_prompt`` opens the assistant's turn.

        ``variables`` are extra template variables (``tools``, ``documents``, ...)."""
        _check_messages(messages)
        import jinja2

        try:
            return _compile(self.source).render(messages=[dict(m) for m in messages],
                                                add_generation_prompt=add_generation_prompt,
                                                **{**self.special_tokens, **variables})
        except jinja2.TemplateError as err:
            raise ConfigError(f"chat template: {err}") from err

    def encode(self, tokenizer: Any, messages: Sequence[Mapping[str, Any]], *,
               add_generation_prompt: bool = True, **variables: Any) -> list[int]:
        """Token ids of the rendered prompt (the template wrote the special tokens; none are added)."""
        return list(tokenizer.encode(self.render(messages, add_generation_prompt=add_generation_prompt,
                                                 **variables)))


def load_chat_template(path: str | Path, name: str = "default") -> ChatTemplate | None:
    """The chat template of a tokenizer directory (or of its ``tokenizer_config.json`` /
    ``tokenizer.json``); ``None`` when it has none. ``name`` picks one of a list of named templates."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    config_file = path if path.name == TOKENIZER_CONFIG else folder / TOKENIZER_CONFIG
    config: dict[str, Any] = {}
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except ValueError as err:
            raise ConfigError(f"{config_file}: not valid JSON ({err})") from None
    specials = {k: v for k in SPECIAL_TOKEN_KEYS if (v := _token_text(config.get(k))) is not None}
    source = config.get("chat_template")
    if source is None and (folder / TEMPLATE_FILE).is_file():
        source = (folder / TEMPLATE_FILE).read_text(encoding="utf-8")
    if source is None:
        return None
    if isinstance(source, list):  # [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        if name not in named:
            raise ConfigError(f"{config_file}: chat_template has no template named {name!r}; it has {sorted(named)}")
        source = named[name]
    if not isinstance(source, str) or not source:
        raise ConfigError(f"{config_file}: chat_template must be a non-empty string, got {type(source).__name__}")
    _compile(source)  # a syntax error shows up now, naming the file
    return ChatTemplate(source, specials)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<|im_end|>", "lstrip": false, ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def _check_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ConfigError(f"messages: must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ConfigError(f"messages[{i}]: must be a dict with 'role' and 'content', got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise ConfigError(f"messages[{i}].role: must be a string, got {message.get('role')!r}")
        content = message.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, Sequence) or isinstance(content, bytes):
            raise ConfigError(f"messages[{i}].content: must be a string or a list of parts, got {content!r}")
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
                raise ConfigError(f"messages[{i}].content[{j}]: must be a dict with a 'type' ('text', 'image', "
                                  f"'image_url'), got {part!r}")


#: keys of an image part that hold the image (transformers' ``{"type": "image", "image" | "url" | "path"}``)
_IMAGE_KEYS = ("image", "url", "path")


def message_images(messages: Sequence[Mapping[str, Any]]) -> list[Any]:
    """The images of ``messages``' image parts, in order (what ``Request.images`` takes beside the
    rendered prompt): transformers' ``{"type": "image", "image": ...}`` (or ``"url"`` / ``"path"``) and
    OpenAI's ``{"type": "image_url", "image_url": {"url": ...}}``. A value is a PIL image, a uint8
    array, a :class:`lockstep.generate.vision.PixelImage`, a local file path (``file://`` too) or a
    ``data:image/...;base64,`` URL; web URLs are refused (nothing is downloaded)."""
    _check_messages(messages)
    images = []
    for i, message in enumerate(messages):
        content = message["content"]
        for j, part in enumerate([] if isinstance(content, str) else content):
            where = f"messages[{i}].content[{j}]"
            if part["type"] == "image_url":
                value = part.get("image_url")
                value = value.get("url") if isinstance(value, Mapping) else value
            elif part["type"] == "image":
                value = next((part[k] for k in _IMAGE_KEYS if part.get(k) is not None), None)
            else:
                continue
            if value is None:
                raise ConfigError(f"{where}: an image part without its image (keys image, url, path or image_url)")
            images.append(_load_image(value, where) if isinstance(value, str) else value)
    return images


def _load_image(reference: str, where: str) -> Any:
    """A PIL image from a local path, a ``file://`` URL or a base64 ``data:`` URL."""
    import base64
    import io

    from PIL import Image

    if reference.startswith(("http://", "https://")):
        raise ConfigError(f"{where}: {reference[:80]!r} is a web URL; images are not downloaded (give a local path, "
                          f"a data: URL or the image itself)")
    try:
        if reference.startswith("data:"):
            # validate: junk characters are an error, not silently skipped (whitespace is allowed)
            payload = base64.b64decode("".join(reference.split(",", 1)[1].split()), validate=True)
            source: Any = io.BytesIO(payload)
        else:
            source = reference[len("file://"):] if reference.startswith("file://") else reference
        with Image.open(source) as image:
            image.load()  # decoded now: a truncated or corrupt file fails here, naming the part
            return image
    # SyntaxError: what PIL's decoders raise for some broken files (e.g. a PNG's bad chunk) while loading
    except (OSError, ValueError, IndexError, SyntaxError, Image.DecompressionBombError) as err:
        raise ConfigError(f"{where}: cannot read the image {reference[:80]!r}: {err}") from None


_COMPILED: dict[str, Any] = {}


def _compile(source: str) -> Any:
    """The template compiled in a sandboxed environment configured as transformers configures it."""
    if source in _COMPILED:
        return _COMPILED[source]
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as err:  # a declared dependency; say what is missing if it was removed
        raise ImportError("chat templates need jinja2 (pip install jinja2)") from err

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers marks assistant tokens): the body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        compiled = env.from_string(source)
    except jinja2.TemplateSyntaxError as err:
        raise ConfigError(f"chat template: syntax error at line {err.lineno}: {err.message}") from err
    _COMPILED[source] = compiled
    return compiled
