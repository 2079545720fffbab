"""The HTTP ingress: OpenAI-compatible FastAPI app on Serve, CPU-only. A thin shell: it validates
requests, forwards them to the SpecExtend replicas through a streaming DeploymentHandle and
formats the replies (JSON or server-sent events). No model, no tokenizer here.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response as PlainResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.serve.handle import DeploymentHandle
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specextend.serving import auth, limits
from specextend.serving import metrics as m
from specextend.serving import protocol as p
from specextend.serving.errors import APIError, BadRequestError, ModelNotFoundError, NotReadyError, api_error
from specextend.serving.settings import INGRESS_CPUS, AppSettings, check_cluster_gpus

log = logging.getLogger(__name__)
app = FastAPI(title="specextend", description="Lossless speculative decoding for long inputs")
# Both middlewares read their settings from this replica's ingress (Serve runs a copy of `app`, so
# the ingress cannot configure the app object it sees): body size and read deadline
# (serving/limits.py); the API key (serving/auth.py), added last so it runs first: a caller
# without the key is refused before its body is read.
app.add_middleware(limits.BodyLimitMiddleware, limits=lambda: _ingress().body_limits)
app.add_middleware(auth.APIKeyMiddleware, key=lambda: _ingress().api_key)


def _ingress() -> "OpenAIIngress":
    return serve.get_replica_context().servable_object


CONTROL_TIMEOUT_S = 3.0  # health / model-info calls to a replica (probes time out at 5 s)
DONE = {"data": "[DONE]"}


@app.exception_handler(APIError)
async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return exc.response()


NESTED_PARAMS = ("speculative_decoding", "stream_options")  # request objects whose fields errors name


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 (and malformed JSON) as OpenAI's 400, naming the first offending field."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    raw = [x for x in first.get("loc", ()) if x != "body"]
    loc = [str(x) for x in raw]
    param = loc[0] if loc and first.get("type") != "json_invalid" else None  # not a character offset
    if param in NESTED_PARAMS and len(loc) > 1:  # e.g. speculative_decoding.max_tree_nodes
        param = f"{param}.{loc[1]}"
    elif param == "messages" and len(raw) > 2 and isinstance(raw[1], int):  # e.g. messages[1].role
        param = f"messages[{raw[1]}].{raw[2]}"
    where = ".".join(loc) or "body"
    msg = f"{where}: {first.get('msg', 'invalid request')}" + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else "")
    return BadRequestError(msg, param).response()


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    err = APIError(str(exc.detail))
    err.status, err.type = exc.status_code, "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return err.response()


@app.exception_handler(Exception)
async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error")
    return api_error(exc).response()


def _usage(item: dict) -> p.Usage:
    return p.Usage(prompt_tokens=item["prompt_tokens"], completion_tokens=item["completion_tokens"],
                   total_tokens=item["prompt_tokens"] + item["completion_tokens"],
                   prompt_tokens_details=p.PromptTokensDetails(cached_tokens=item.get("cached_tokens", 0)))


class _Formatter:
    """Replica items -> OpenAI response objects (whole or chunks)."""

    def __init__(self, rid: str, model: str, chat: bool, token_ids: bool) -> None:
        self.rid, self.model, self.chat, self.token_ids = rid, model, chat, token_ids

    @property
    def object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def event(self, resp: p.Response) -> dict:
        return {"data": resp.model_dump_json()}

    def _choice(self, text: str, ids: Optional[list[int]], finish: Optional[str], stream: bool, prompt_ids=None):
        ids = ids if self.token_ids else None
        if not self.chat:
            return p.CompletionChoice(text=text, finish_reason=finish, token_ids=ids, prompt_token_ids=prompt_ids)
        if stream:
            return p.ChatChoice(delta=p.DeltaMessage(content=text), finish_reason=finish, token_ids=ids)
        return p.ChatChoice(message=p.ChatMessageOut(content=text), finish_reason=finish, token_ids=ids)

    def chunk(self, text: str, ids: Optional[list[int]], last: Optional[dict], role: bool = False) -> p.Response:
        finish = last.get("finish_reason") if last else None
        prompt_ids = last.get("prompt_token_ids") if last and self.token_ids else None  # (the first item's)
        choice = self._choice(text, ids, finish, True, None if self.chat else prompt_ids)
        if role:
            choice.delta = p.DeltaMessage(role="assistant", content="")
        return p.Response(id=self.rid, object=self.object, model=self.model, choices=[choice],
                          speculative_decoding=last.get("speculative_decoding") if finish else None,
                          prompt_token_ids=prompt_ids if self.chat else None)

    def whole(self, items: list[dict]) -> p.Response:
        last = items[-1]
        text = "".join(i["text"] for i in items)
        ids = [t for i in items for t in i["token_ids"]]
        prompt_ids = items[0]["prompt_token_ids"] if self.token_ids else None
        choice = self._choice(text, ids, last["finish_reason"], False, None if self.chat else prompt_ids)
        return p.Response(id=self.rid, object="chat.completion" if self.chat else "text_completion",
                          model=self.model, choices=[choice], usage=_usage(last),
                          speculative_decoding=last["speculative_decoding"],
                          prompt_token_ids=prompt_ids if self.chat else None)


@serve.deployment(name="OpenAIIngress", ray_actor_options={"num_cpus": INGRESS_CPUS}, max_ongoing_requests=4096)
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, engine: DeploymentHandle, settings: dict) -> None:
        self.settings = AppSettings.model_validate(settings)
        self.api_key = auth.resolve_key(self.settings.api_key)
        # In the cluster: catches `serve run` without a cluster at build time (fails the app).
        check_cluster_gpus(self.settings)
        self.stream_handle = engine.options(stream=True)
        self.handle = engine.options(stream=False)
        self._model: Optional[str] = self.settings.served_model_name
        self._max_prompt_tokens: Optional[int] = None
        self.body_limits = limits.BodyLimits(self.settings.max_request_bytes, self.settings.request_read_timeout_s)

    async def _control(self, method: str):
        try:
            return await asyncio.wait_for(getattr(self.handle, method).remote(), CONTROL_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - not up yet (constructor running), or gone
            raise NotReadyError("the model is not ready yet (loading or warming up)") from e

    async def _model_name(self) -> str:
        if self._model is None:
            self._model = (await self._control("model_info"))["id"]
        return self._model

    async def _check_model(self, model: Optional[str]) -> str:
        name = await self._model_name()
        if model is not None and model != name:
            raise ModelNotFoundError(f"the model `{model}` does not exist; this server serves `{name}`", "model")
        return name

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health(self) -> JSONResponse:
        try:
            info = await self._control("health")
        except NotReadyError as e:
            return e.response()
        return JSONResponse(info, status_code=200 if info.get("ready") else 503)

    @app.get("/v1/models")
    async def models(self) -> JSONResponse:
        info = await self._control("model_info")
        cards = [p.ModelCard(id=await self._model_name(), max_model_len=info["max_model_len"])]
        return JSONResponse(p.ModelList(data=cards).model_dump(mode="json"))

    @app.get("/metrics")
    async def metrics(self) -> PlainResponse:
        text = m.merge_expositions(await asyncio.to_thread(m.collect_published))
        return PlainResponse(text, media_type=CONTENT_TYPE_LATEST)

    async def _check_prompt_ids(self, prompt: dict) -> None:
        """A token-id prompt over the limit is refused here, before it is shipped to a replica."""
        if prompt.get("prompt_ids") is None:
            return
        if self._max_prompt_tokens is None:
            self._max_prompt_tokens = (await self._control("model_info"))["max_prompt_tokens"]
        if len(prompt["prompt_ids"]) > self._max_prompt_tokens:
            raise BadRequestError(f"the prompt has {len(prompt['prompt_ids'])} token ids; at most "
                                  f"{self._max_prompt_tokens} are allowed", "prompt")

    @app.post("/v1/completions")
    async def completions(self, body: p.CompletionRequest):
        p.check_supported(body)
        prompt = body.engine_prompt()
        await self._check_prompt_ids(prompt)
        return await self._serve(body, prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: p.ChatCompletionRequest):
        p.check_supported(body)
        return await self._serve(body, {"messages": [msg.template_dict() for msg in body.messages]}, chat=True)

    # ------------------------------------------------------------------ one request

    async def _serve(self, body: Union[p.CompletionRequest, p.ChatCompletionRequest], prompt: dict, chat: bool):
        model = await self._check_model(body.model)
        rid = p.request_id(chat)
        gen = None
        try:  # the first item (after admission and prefill) decides the HTTP status
            req = {**prompt, **body.sampling(), "request_id": rid, "return_prompt_ids": body.return_token_ids,
                   "stream": body.stream}  # a whole response comes as one item
            gen = self.stream_handle.generate.remote(req)
            first = await gen.__anext__()
        except BaseException as e:
            if gen is not None:
                gen.cancel()
            raise api_error(e) if isinstance(e, Exception) else e
        if "error" in first:  # the request's own fault (4xx), handed back as an item
            raise APIError.from_body(first["error"])
        fmt = _Formatter(rid, model, chat, body.return_token_ids)
        if not body.stream:
            try:
                items = [first] + [item async for item in gen]
            except BaseException:
                gen.cancel()  # client gone or replica failed: free the session
                raise
            return JSONResponse(fmt.whole(items).model_dump(mode="json"))
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventSourceResponse(self._events(gen, first, fmt, usage), sep="\n")

    async def _events(self, gen, first: dict, fmt: "_Formatter", include_usage: bool):
        item, done = first, False
        try:
            if fmt.chat:
                yield fmt.event(fmt.chunk("", None, None, role=True))
            while True:
                yield fmt.event(fmt.chunk(item["text"], item["token_ids"], item))
                if item["finish_reason"]:
                    done = True
                    break
                item = await gen.__anext__()
            if include_usage:
                yield fmt.event(p.Response(id=fmt.rid, object=fmt.object, model=fmt.model, choices=[],
                                           usage=_usage(item)))
            yield DONE
        except (StopAsyncIteration, Exception) as e:  # the replica failed mid-stream: say so, end
            log.warning("stream %s failed: %s", fmt.rid, e)
            yield {"data": json.dumps(api_error(e if isinstance(e, Exception) else RuntimeError(e)).body())}
            yield DONE
        finally:
            if not done:  # client gone (or failure): stop the replica's work, free the session
                gen.cancel()
