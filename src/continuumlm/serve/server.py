"""``continuumlm serve``: load a checkpoint, start the engine, serve the application with
uvicorn until SIGTERM or SIGINT, which drain (running requests finish) and exit 0."""

from __future__ import annotations

import dataclasses
import signal
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
    import torch

    state = model.init_state(1)  # the caches a request's rows will have
    with torch.inference_mode():
        model.step(torch.zeros(1, 1, dtype=torch.long,
                               device=next(model.parameters()).device), state)
    for key, c in state._caches.items():
        missing = [m for m in ("regroup", "put_rows") if not hasattr(c, m)]
        if missing:
            raise ServeError(f"the decoding cache {type(c).__name__} (of {key!r}) has no "
                             f"{' or '.join(missing)}, which the server needs to let requests "
                             f"join and leave a running batch; give the cache type those "
                             f"methods (continuumlm.mixers.cache.SeqCache has both).")
    if not all(getattr(m, "supports_padding", True) for m in model.modules()
               if hasattr(m, "cache_factory")):
        raise ServeError("a mixer of this model does not take padded batches "
                         "(supports_padding), and the server pads rows of different lengths "
                         "into one batch.")


def make_server(model, tokenizer, *, model_name: str, host: str = "127.0.0.1",
                port: int = 8000, max_batch: int = 32, max_queue: int = 256,
                max_context: int | None = None, max_tokens: int = 4096,
                max_body_bytes: int = 1 << 20, threads=None, max_prefill_tokens: int = 256,
                lean: bool = True, exit_rule: tuple[str, float] | None = None,
                quiet: bool = False):
    """(the uvicorn server, its engine): ``server.run()`` serves until SIGTERM or SIGINT
    (``server.should_exit = True`` from another thread); ``server.port`` is the port bound
    once it has started (``port=0``: any free one)."""
    import uvicorn

    from .app import create_app
    from .engine import Engine
    from .protocol import Limits

    engine = Engine(model, tokenizer, max_batch=max_batch, max_queue=max_queue,
                    threads=threads, max_prefill_tokens=max_prefill_tokens, lean=lean)
    if exit_rule is not None:
        engine.default = dataclasses.replace(engine.default, exit=exit_rule)
    app = create_app(engine, tokenizer, model_name,
                     Limits(max_context or model.config.max_seq_len, max_tokens),
                     max_body_bytes)

    class Server(uvicorn.Server):
        port: int | None = None

        def handle_exit(self, sig, frame) -> None:
            # drain, then return: uvicorn would raise the signal again after its shutdown,
            # ending the process by it instead of with status 0
            if self.should_exit and sig == signal.SIGINT:  # a second ^C: stop at once
                self.force_exit = True
            self.should_exit = True

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                self.port = self.servers[0].sockets[0].getsockname()[1]
                d = engine.default
                depth = f"{d.solver} x {d.steps}" if d.solver else "discrete"
                if not quiet:
                    print(f"serving {model_name!r} at http://{host}:{self.port}/v1 ({depth}; "
                          f"up to {max_batch} rows decoded together, {max_queue} waiting)",
                          flush=True)

    config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                            access_log=False, lifespan="on")
    return Server(config), engine


def serve(model, tokenizer, **kwargs) -> int:
    """Serve until SIGTERM or SIGINT; 0 once drained, 1 if the engine failed."""
    server, engine = make_server(model, tokenizer, **kwargs)
    server.run()
    if engine.error is not None:
        print(f"error: the serving engine stopped: {engine.error}", file=sys.stderr)
        return 1
    return 0
