"""``continuumlm serve``: load a checkpoint, start the engine, serve the application with
uvicorn until SIGTERM or SIGINT, which drain (running requests finish) and exit 0."""

from __future__ import annotations

import dataclasses
import sys

from ..errors import ContinuumLMError


class ServeError(ContinuumLMError):
    pass


def missing_extra() -> str | None:
    """Why the serving extra cannot be imported, or None."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        return (f"continuumlm serve needs FastAPI and uvicorn ({e.name} is not installed); "
                f"install them with: pip install 'continuumlm[serve]'")
    return None


def check_servable(model) -> None:
    """Refuse, before listening, a model the engine cannot decode with exact caches."""
    cacheless = model.cacheless_mixers()
    if cacheless:
        raise ServeError(f"the mixer {', '.join(map(repr, cacheless))} has no decoding cache, "
                         f"and the server decodes every request through caches (continuous "
                         f"batching); serve a model whose mixers keep one, or generate with "
                         f"continuumlm generate --no-cache.")
    if not getattr(model.depth, "exact_cache", True):
        raise ServeError(f"the model's solver {model.config.ode_solver!r} chooses its own "
                         f"steps and cannot decode with exact caches; serve it with a "
                         f"fixed-grid solve: --ode-solver rk4 --ode-steps N.")
    if model.config.mode != "decoder":
        raise ServeError("this model is an encoder (mode = 'encoder'); only decoders generate.")


def serve(model, tokenizer, *, model_name: str, host: str, port: int, max_batch: int,
          max_queue: int, max_context: int, max_tokens: int, max_body_bytes: int,
          threads=None, exit_rule: tuple[str, float] | None = None, ready=None) -> int:
    import uvicorn

    from .app import create_app
    from .engine import Engine
    from .protocol import Limits

    engine = Engine(model, tokenizer, max_batch=max_batch, max_queue=max_queue,
                    threads=threads)
    if exit_rule is not None:
        engine.default = dataclasses.replace(engine.default, exit=exit_rule)
    app = create_app(engine, tokenizer, model_name, Limits(max_context, max_tokens),
                     max_body_bytes)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # drain, then return: uvicorn would raise the signal again after its shutdown,
            # ending the process by it instead of with status 0
            if self.should_exit and sig == 2:  # a second SIGINT: stop without draining
                self.force_exit = True
            self.should_exit = True

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                bound = self.servers[0].sockets[0].getsockname()[1] if self.servers else port
                d = engine.default
                depth = f"{d.solver} x {d.steps}" if d.solver else "discrete"
                print(f"serving {model_name!r} at http://{host}:{bound}/v1 ({depth}; up to "
                      f"{max_batch} rows decoded together, {max_queue} waiting)", flush=True)
                if ready is not None:
                    ready(bound)

    config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                            access_log=False, lifespan="on")
    server = Server(config)
    server.run()
    if engine.error is not None:
        print(f"error: the serving engine stopped: {engine.error}", file=sys.stderr)
        return 1
    return 0
