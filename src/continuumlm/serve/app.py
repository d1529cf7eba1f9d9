"""The HTTP face of the engine: OpenAI's completion API (JSON and server-sent events), the
model list, health, and vLLM's tokenizer endpoints (``/tokenize``, ``/detokenize``,
``/tokenizer_info``, which lm-evaluation-harness's ``local-completions`` reads), on FastAPI."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine import Closed, Engine, QueueFull
from .protocol import (
    APIError,
    ChatBody,
    CompletionBody,
    Limits,
    check_depth,
    check_lengths,
    draft_of,
    encode,
    parse,
    prompts_of,
    sampling_of,
    stops_of,
)
from .request import Event
from .request import Request as Job


async def read_json(request: Request, limit: int):
    """The body as JSON, refused (413) past ``limit`` bytes and (400) when not JSON."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limit:
        raise APIError(413, f"the request body has {size} bytes, more than this server's "
                            f"limit of {limit} (serve --max-body-bytes).")
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise APIError(413, f"the request body is larger than this server's limit of "
                                f"{limit} bytes (serve --max-body-bytes).")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}.") from None


class Choices:
    """What one request's choices have produced so far, from the engine's events."""

    def __init__(self, tokenizer, rows: int, n: int, logprobs: bool) -> None:
        self.tok, self.n, self.logprobs = tokenizer, n, logprobs
        self.text = [""] * rows
        self.finish: list[str | None] = [None] * rows
        self.count = [0] * rows
        self.nfe = [0] * rows
        self.lp = [{"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                   for _ in range(rows)]
        self.error: str | None = None

    def piece(self, token: int) -> str:
        return self.tok.decode([token])

    def _log(self, i: int, tokens, logprobs) -> None:
        lp = self.lp[i]
        for t, (value, top) in zip(tokens, logprobs):
            offset = (lp["text_offset"][-1] + len(lp["tokens"][-1])) if lp["tokens"] else 0
            lp["tokens"].append(self.piece(t))
            lp["token_logprobs"].append(value)
            lp["top_logprobs"].append(None if top is None else
                                      {self.piece(k): v for k, v in top.items()})
            lp["text_offset"].append(offset)

    def take(self, e: Event) -> list[tuple[int, str]]:
        """Record the event; return the (choice, text) pieces it adds."""
        if e.kind == "error":
            self.error = e.message
            return []
        if e.kind == "prompt":
            text = self.tok.decode(e.tokens)
            out = []
            for i in range(e.index * self.n, (e.index + 1) * self.n):
                self.text[i] += text
                if self.logprobs and e.logprobs is not None:
                    self._log(i, e.tokens, e.logprobs)
                out.append((i, text))
            return out
        if e.kind == "done":
            self.finish[e.index], self.count[e.index] = e.finish_reason, e.count
            self.nfe[e.index] = e.nfe
            return []
        self.text[e.index] += e.text
        if self.logprobs and e.token is not None:
            self._log(e.index, [e.token], [(e.logprob, e.top)])
        return [(e.index, e.text)] if e.text else []

    @property
    def finished(self) -> bool:
        return self.error is not None or all(f is not None for f in self.finish)

    def usage(self, prompt_tokens: int) -> dict:
        done = sum(self.count)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": done,
                "total_tokens": prompt_tokens + done,
                # the extension: the vector field's evaluations the completion's tokens took
                "field_evaluations": sum(self.nfe),
                "field_evaluations_per_token": round(sum(self.nfe) / done, 4) if done else 0.0}


def create_app(engine: Engine, tokenizer, model_name: str, limits: Limits,
               max_body_bytes: int = 1 << 20) -> FastAPI:
    model = engine.model
    vocab = model.config.vocab_size
    eos = tokenizer.eos_id if getattr(tokenizer, "kind", None) == "bpe" else None
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if engine.thread is None:
            engine.start()
        try:
            yield
        finally:  # after uvicorn's drain: every admitted and waiting request finishes
            await asyncio.get_running_loop().run_in_executor(None, engine.close)

    app = FastAPI(title="continuumlm serve", lifespan=lifespan)
    app.state.engine = engine

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(),
                            status_code=e.status_code)

    @app.get("/health")
    async def health():
        alive = engine.thread is not None and engine.thread.is_alive() and engine.error is None
        body = {"status": "ok" if alive else "error", **engine.stats()}
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/v1/models")
    async def models():
        d = engine.default
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "continuumlm",
            "max_model_len": limits.max_context,
            "depth": {"ode_solver": d.solver, "ode_steps": d.steps,
                      "exit": list(d.exit) if d.exit else None}}]}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        eos_text = tokenizer.decode([tokenizer.eos_id]) if eos is not None else None
        return {"eos_token": eos_text, "bos_token": None, "pad_token": None,
                "chat_template": None, "model_max_length": limits.max_context,
                "tokenizer_class": getattr(tokenizer, "kind", type(tokenizer).__name__)}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        data = await read_json(request, max_body_bytes)
        text = data.get("prompt") if isinstance(data, dict) else None
        if not isinstance(text, str):
            raise APIError(400, "'prompt': give the text to tokenize as a string.", "prompt")
        ids = encode(tokenizer, text)
        return {"tokens": ids, "count": len(ids), "max_model_len": limits.max_context}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        data = await read_json(request, max_body_bytes)
        ids = data.get("tokens") if isinstance(data, dict) else None
        if not (isinstance(ids, list) and all(isinstance(t, int) and 0 <= t < vocab
                                              for t in ids)):
            raise APIError(400, f"'tokens': give a list of token ids from 0 to {vocab - 1}.",
                           "tokens")
        return {"prompt": tokenizer.decode(ids)}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = parse(ChatBody, await read_json(request, max_body_bytes))
        check_model(body.model)
        raise APIError(400, f"the model {model_name!r} has no chat template (its tokenizer, "
                            f"{getattr(tokenizer, 'kind', 'custom')}, carries none), so chat "
                            f"messages cannot be turned into a prompt; use /v1/completions "
                            f"with a prompt.", "messages")

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                                f"{model_name!r} (GET /v1/models).", "model",
                           code="model_not_found")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = parse(CompletionBody, await read_json(request, max_body_bytes))
        check_model(body.model)
        prompts = prompts_of(body, tokenizer, vocab)
        max_tokens = check_lengths(prompts, body, limits)
        depth = check_depth(model, body, engine.default)
        draft = draft_of(model, body, prompts)
        if draft is not None:  # a draft decodes at the model's full depth, token by token
            depth = dataclasses.replace(depth, exit=None)
        if len(prompts) * body.n > engine.max_queue:
            raise APIError(400, f"the request asks for {len(prompts)} prompts x n = {body.n} "
                                f"rows, more than this server ever queues (--max-queue "
                                f"{engine.max_queue}); send fewer at a time.", "prompt")
        sampling = sampling_of(body)
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def sink(event: Event) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, event)

        job = Job(prompts, max_tokens, sink, depth=depth, sampling=sampling, n=body.n,
                  stop=stops_of(body), eos_id=eos, logprobs=body.logprobs, echo=body.echo,
                  draft=draft)
        try:
            engine.submit(job)
        except QueueFull as e:
            raise APIError(429, str(e), type="rate_limit_error") from None
        except Closed as e:
            raise APIError(503, str(e), type="server_error") from None
        choices = Choices(tokenizer, job.rows, body.n, body.logprobs is not None)
        rid, stamp = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        prompt_tokens = sum(map(len, prompts))

        def chunk(pieces: list[dict], usage: dict | None = None) -> str:
            out = {"id": rid, "object": "text_completion", "created": stamp,
                   "model": model_name, "choices": pieces}
            if usage is not None:
                out["usage"] = usage
            return f"data: {json.dumps(out)}\n\n"

        if body.stream:
            async def events():
                try:
                    while not choices.finished:
                        e = await queue.get()
                        pieces = [{"index": i, "text": t, "logprobs": None,
                                   "finish_reason": None} for i, t in choices.take(e)]
                        if e.kind == "token" and body.logprobs is not None \
                                and e.token is not None:
                            lp = choices.lp[e.index]
                            piece = {k: v[-1:] for k, v in lp.items()}
                            if pieces:
                                pieces[0]["logprobs"] = piece
                            else:
                                pieces = [{"index": e.index, "text": "", "logprobs": piece,
                                           "finish_reason": None}]
                        if e.kind == "done":
                            pieces = [{"index": e.index, "text": "", "logprobs": None,
                                       "finish_reason": e.finish_reason}]
                        if e.kind == "error":
                            failed = APIError(500, e.message, type="server_error")
                            yield f"data: {json.dumps(failed.body())}\n\n"
                            break
                        if pieces:
                            yield chunk(pieces)
                    if choices.error is None and body.stream_options is not None \
                            and body.stream_options.include_usage:
                        yield chunk([], choices.usage(prompt_tokens))
                    yield "data: [DONE]\n\n"
                finally:
                    if not choices.finished:
                        job.cancel()  # the client went away: free its rows

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})

        try:
            while not choices.finished:
                try:
                    choices.take(await asyncio.wait_for(queue.get(), 0.5))
                except asyncio.TimeoutError:  # (not the builtin TimeoutError before 3.11)
                    if await request.is_disconnected():
                        job.cancel()
                        return JSONResponse({}, status_code=499)
        except asyncio.CancelledError:
            job.cancel()
            raise
        if choices.error is not None:
            raise APIError(500, choices.error, type="server_error")
        return {"id": rid, "object": "text_completion", "created": stamp, "model": model_name,
                "choices": [{"index": i, "text": choices.text[i],
                             "logprobs": choices.lp[i] if body.logprobs is not None else None,
                             "finish_reason": choices.finish[i]}
                            for i in range(job.rows)],
                "usage": choices.usage(prompt_tokens)}

    return app
