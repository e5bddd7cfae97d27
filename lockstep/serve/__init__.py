"""An OpenAI-compatible HTTP server over the generation engine (``lockstep serve``).

    from lockstep.serve import BackgroundServer, create_app
    app = create_app(engine, model_name="tiny", chat_template=template)   # any engine with Engine's request API
    with BackgroundServer(app) as server:                                  # uvicorn on a free 127.0.0.1 port
        openai.OpenAI(base_url=server.base_url + "/v1", api_key="-").completions.create(...)

Modules: :mod:`~lockstep.serve.loop` (the engine thread: continuous batching, bounded queue),
:mod:`~lockstep.serve.protocol` (request bodies, 400s naming the field), :mod:`~lockstep.serve.responses`
(OpenAI JSON and stream chunks), :mod:`~lockstep.serve.app` (FastAPI routes), :mod:`~lockstep.serve.server`
(uvicorn), :mod:`~lockstep.serve.cli` (``lockstep serve``), :mod:`~lockstep.serve.agent` (RL environments
against a served policy). See docs/generation.md, "Serving".
"""

from lockstep.serve.app import create_app
from lockstep.serve.loop import EngineLoop, ServableEngine
from lockstep.serve.server import BackgroundServer, run_server

__all__ = ["BackgroundServer", "EngineLoop", "ServableEngine", "create_app", "run_server"]
