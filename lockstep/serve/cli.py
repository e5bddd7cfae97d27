"""``lockstep serve``: an OpenAI-compatible HTTP server over a model or run directory.

    lockstep serve --checkpoint DIR [--host 127.0.0.1] [--port 8000] [--engine lockstep|vllm]
                   [--max-batch-size 32] [--max-queue 64] [--cache-mb 512] [--served-model-name NAME]
                   [--allowed-image-dir DIR] [--max-images-per-request 8] [--max-image-pixels 16777216]

DIR is anything ``lockstep generate`` loads (:mod:`lockstep.load`). Every flag is checked before the
model is loaded; a bad one is a ``ConfigError`` naming the flag. ``--engine vllm`` serves a
:class:`lockstep.vllm.VllmEngine` (vLLM running lockstep's modules) built by
``lockstep.vllm.build_engine``; it is closed when the server stops. The image flags bound chat
image parts (:mod:`lockstep.serve.images`); the engine's image pixel bounds come from the model
directory's ``preprocessor_config.json``, as for ``lockstep generate --chat --image``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from lockstep.config.base import ConfigError
from lockstep.serve.images import DEFAULT_MAX_IMAGES, DEFAULT_MAX_PIXELS, ImageLimits

ENGINES = ("lockstep", "vllm")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lockstep serve", description=(
        "Serve a model over OpenAI's HTTP API (/v1/completions, /v1/chat/completions, /v1/models)."))
    parser.add_argument("--checkpoint", required=True, metavar="DIR",
                        help="Hugging Face model dir, lockstep model dir, training run dir (latest checkpoint), "
                             "a llama .gguf file, or a pretrained name (smollm2)")
    parser.add_argument("--step", type=int, default=None, help="a run directory's checkpoint step (default: latest)")
    parser.add_argument("--allow-unverified-weights", action="store_true",
                        help="also load weight files that carry no lockstep checksums")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    parser.add_argument("--engine", default="lockstep", choices=ENGINES, help="generation engine")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send (default: the checkpoint directory's name)")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="Jinja chat template file (or tokenizer_config.json) to use instead of the model's")
    parser.add_argument("--max-batch-size", type=int, default=32, help="most requests decoded together")
    parser.add_argument("--max-queue", type=int, default=64,
                        help="most requests waiting beyond the running batch; one more is answered 429")
    parser.add_argument("--cache-mb", type=float, default=512.0, help="KV-cache memory in MiB")
    parser.add_argument("--default-max-tokens", type=int, default=1024,
                        help="a chat request's max_tokens when it gives none (capped by the context; the engine "
                             "reserves cache blocks for every request's max_tokens)")
    parser.add_argument("--allowed-image-dir", default=None, metavar="DIR",
                        help="chat image parts may name files inside DIR as file:///path URLs (default: none; "
                             "images come as data:image/...;base64 URLs)")
    parser.add_argument("--max-images-per-request", type=int, default=DEFAULT_MAX_IMAGES,
                        help="most images in one chat request (one more: 400)")
    parser.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_PIXELS,
                        help="largest image (width x height) a request may send, checked before decoding (the "
                             "model's processor then resizes it to its own pixel bounds)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"],
                        help="weight dtype (auto: as stored)")
    parser.add_argument("--device", default="auto", help="auto (CUDA when available), cpu or cuda")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    args = _parser().parse_args(argv)
    checkpoint = Path(args.checkpoint).expanduser()
    if not checkpoint.exists() and len(checkpoint.parts) > 1:
        raise ConfigError(f"--checkpoint {checkpoint}: no such directory")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port: must be in [0, 65535], got {args.port}")
    if args.max_batch_size < 1:
        raise ConfigError(f"--max-batch-size: must be >= 1, got {args.max_batch_size}")
    if args.max_queue < 0:
        raise ConfigError(f"--max-queue: must be >= 0, got {args.max_queue}")
    if args.cache_mb <= 0:
        raise ConfigError(f"--cache-mb: must be > 0, got {args.cache_mb}")
    if args.default_max_tokens < 1:
        raise ConfigError(f"--default-max-tokens: must be >= 1, got {args.default_max_tokens}")
    if args.step is not None and args.step < 0:
        raise ConfigError(f"--step: must be >= 0, got {args.step}")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ConfigError("--served-model-name: must not be empty")
    image_limits(args).validate()
    if args.engine == "vllm":
        vllm_factory()  # a missing lockstep.vllm shows now, before loading the model
    from lockstep.run.config import validate_device

    validate_device(args.device, "--device")
    return args


def image_limits(args: argparse.Namespace) -> ImageLimits:
    """The image flags as :class:`~lockstep.serve.images.ImageLimits`."""
    allowed = Path(args.allowed_image_dir).expanduser() if args.allowed_image_dir is not None else None
    return ImageLimits(max_images=args.max_images_per_request, max_pixels=args.max_image_pixels, allowed_dir=allowed)


def vllm_factory() -> Any:
    """``lockstep.vllm.build_engine`` (``build_engine(kind, model, tokenizer, EngineConfig)``), checked:
    a missing lockstep.vllm or vllm package is a ConfigError naming ``--engine``."""
    try:
        module = importlib.import_module("lockstep.vllm")
    except ModuleNotFoundError as err:
        if err.name and err.name.startswith("lockstep.vllm"):
            raise ConfigError("--engine vllm: the vLLM engine (lockstep.vllm) is not part of this installation; "
                              "use --engine lockstep") from None
        raise
    factory = getattr(module, "build_engine", None)
    if factory is None:
        raise ConfigError("--engine vllm: lockstep.vllm has no build_engine() to serve with")
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError("--engine vllm: the vllm package is not installed (the vllm extra: make setup; see "
                          "docs/generation.md, 'vLLM')")
    return factory


def build_engine(kind: str, model: Any, tokenizer: Any, *, cache_mb: float, max_batch_size: int,
                 model_dir: str | Path | None = None) -> Any:
    """The engine ``--engine`` names, over an already-loaded model (``model_dir``: where its
    ``preprocessor_config.json`` gives the image pixel bounds, if it has one)."""
    from lockstep.generate import Engine, EngineConfig
    from lockstep.generate.vision import image_pixel_bounds

    bounds = image_pixel_bounds(model_dir) if model_dir is not None else {}
    config = EngineConfig(cache_memory_mb=cache_mb, max_batch_size=max_batch_size, **bounds)
    if kind == "vllm":
        return vllm_factory()("vllm", model, tokenizer, config)
    return Engine(model, tokenizer, config)


def cmd_serve(argv: list[str]) -> int:
    """``lockstep serve ...``: serve until interrupted."""
    args = parse_args(argv)
    from lockstep.cli_generate import _load

    from lockstep.serve.app import create_app
    from lockstep.serve.server import run_server

    source = _load(args, need_template=False)
    engine = build_engine(args.engine, source.model, source.tokenizer, cache_mb=args.cache_mb,
                          max_batch_size=args.max_batch_size, model_dir=source.path)
    name = args.served_model_name or Path(args.checkpoint).expanduser().name or str(args.checkpoint)
    app = create_app(engine, model_name=name, chat_template=source.chat_template,
                     stop_token_ids=source.stop_token_ids, max_batch_size=args.max_batch_size,
                     max_queue=args.max_queue, default_chat_tokens=args.default_max_tokens,
                     image_limits=image_limits(args))
    print(f"lockstep serve: {source.description} as {name!r} ({args.engine} engine) on "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr)
    run_server(app, args.host, args.port, args.log_level)
    return 0
