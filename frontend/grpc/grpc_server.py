"""The client gRPC API (proto/pagedserve.proto) on grpc.aio, sharing the
frontend's engine client, tokenizer and generator with the HTTP API.

Bad input answers INVALID_ARGUMENT (NOT_FOUND for an unknown model,
UNAVAILABLE when the engine is down); a cancelled Generate stream aborts
its request in the scheduler. With an API key, every call needs the metadata
`authorization: Bearer <key>` (UNAUTHENTICATED otherwise).
"""
from __future__ import annotations

import time
from contextlib import aclosing
from typing import AsyncIterator

import grpc
from google.protobuf import json_format

from common.addresses import GRPC_SERVER_OPTIONS, bind_grpc_port
from common.errors import InvalidRequestError, PagedServeError
from common.grpc_gen import pagedserve_pb2 as pb
from common.grpc_gen import pagedserve_pb2_grpc
from common.protocol import TokenLogprobs
from common.sampling_params import MAX_LOGPROBS, SamplingParams
from common.structured_outputs import StructuredOutputs
from common.sample_choices import SampleResult, best_samples
from frontend.api_errors import AuthenticationError, grpc_code
from frontend.http_guards import api_key_matches
from frontend.engine.generation import GenerationDelta
from frontend.grpc.grpc_embed import embed_response
from frontend.engine.generation_request import GenerationRequest
from frontend.engine.token_texts import TokenTexts
from frontend.prompt_extras import echoed_prompt, encoded_prompt, truncated_prompt, with_bad_words_tokenized
from frontend.openai.serving_tokenize import detokenize_ids
from frontend.frontend_state import FrontendState, random_id

_FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
                   "abort": pb.FINISH_REASON_ABORT}


def sampling_params_from_proto(message: pb.SamplingParams, vocab_size: int | None = None,
                               model_defaults: dict[str, float | int] | None = None,
                               max_logprobs: int = MAX_LOGPROBS) -> SamplingParams:
    """Unset optional fields keep the HTTP API's defaults (or the model's,
    `model_defaults`); max_tokens unset means "as many as fit in the context"."""
    defaults = SamplingParams.with_defaults(model_defaults)

    def get(name: str, default):
        return getattr(message, name) if message.HasField(name) else default

    return SamplingParams(
        n=get("n", defaults.n), best_of=get("best_of", None),
        temperature=get("temperature", defaults.temperature), top_p=get("top_p", defaults.top_p),
        top_k=get("top_k", defaults.top_k), min_p=get("min_p", defaults.min_p), seed=get("seed", None),
        presence_penalty=get("presence_penalty", 0.0), frequency_penalty=get("frequency_penalty", 0.0),
        repetition_penalty=get("repetition_penalty", defaults.repetition_penalty), logit_bias=dict(message.logit_bias),
        max_tokens=get("max_tokens", None), min_tokens=message.min_tokens, ignore_eos=message.ignore_eos,
        stop_token_ids=list(message.stop_token_ids), stop=list(message.stop),
        include_stop_str_in_output=message.include_stop_str_in_output,
        logprobs=get("logprobs", None), prompt_logprobs=get("prompt_logprobs", None),
        skip_special_tokens=get("skip_special_tokens", True),
        spaces_between_special_tokens=get("spaces_between_special_tokens", True),
        structured_outputs=structured_outputs_from_proto(message),
        allowed_token_ids=list(message.allowed_token_ids) or None, bad_words=list(message.bad_words),
        truncate_prompt_tokens=get("truncate_prompt_tokens", None)).validate(vocab_size, max_logprobs)


STRUCTURED_OUTPUTS_PARAM = "sampling_params.structured_outputs"


def structured_outputs_from_proto(message: pb.SamplingParams) -> StructuredOutputs | None:
    if not message.HasField("structured_outputs"):
        return None
    asked = message.structured_outputs
    fields = {name: getattr(asked, name) if asked.HasField(name) else None for name in ("json", "regex", "grammar")}
    return StructuredOutputs.of(STRUCTURED_OUTPUTS_PARAM, **fields, choice=list(asked.choice) or None,
                                json_object=asked.json_object)


class PagedServeServicer(pagedserve_pb2_grpc.PagedServeServicer):
    def __init__(self, state: FrontendState):
        self.state = state

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        arrival = time.monotonic()
        try:
            generation, echo = await self._prepare(request, arrival)
        except PagedServeError as e:
            await context.abort(grpc_code(e), e.message)
        reply = _Reply(generation.request_id, self.state.generator.token_texts, request.sampling_params,
                       generation.prompt_token_ids)
        params = generation.sampling_params
        # A cancelled RPC cancels this task; closing the deltas aborts the request.
        async with aclosing(self.state.generator.generate(generation)) as deltas:
            try:
                if params.num_samples > params.n:
                    async for response in _best_of_responses(reply, deltas, params, echo):
                        yield response
                    return
                echoed: set[int] = set()
                async for delta in deltas:
                    text = delta.text if delta.index in echoed else echo + delta.text
                    echoed.add(delta.index)
                    yield reply.response(delta.index, delta.token_ids, text, delta.logprobs, delta.finish_reason,
                                         delta.stop_reason, delta.prompt_logprobs,
                                         delta if delta.request_finished else None)
            except PagedServeError as e:
                await context.abort(grpc_code(e), e.message)

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        try:
            self.state.check_model(request.model or None)
            field = request.WhichOneof("input")
            if field == "text":
                add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
                ids = await self.state.tokenizer_client.encode(request.text, add_special_tokens=add_special)
            elif field == "chat":
                ids = await self._render_chat(request.chat)
            else:
                raise _invalid("one of text or chat is required", "input")
        except PagedServeError as e:
            await context.abort(grpc_code(e), e.message)
        return pb.TokenizeResponse(token_ids=ids, count=len(ids),
                                   max_model_len=await self.state.max_model_len() or 0)

    async def Detokenize(self, request: pb.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> pb.DetokenizeResponse:
        try:
            text = await detokenize_ids(self.state, request.model or None, list(request.token_ids),
                                        param="token_ids")
        except PagedServeError as e:
            await context.abort(grpc_code(e), e.message)
        return pb.DetokenizeResponse(text=text)

    async def ListModels(self, request, context) -> pb.ListModelsResponse:
        max_model_len = await self.state.max_model_len() or 0
        return pb.ListModelsResponse(models=[
            pb.Model(id=name, owned_by="pagedserve", created=self.state.created, root=self.state.model_root,
                     max_model_len=max_model_len) for name in self.state.served_model_names] + [
            pb.Model(id=name, owned_by="pagedserve", created=self.state.created, root=lora.lora_path,
                     parent=self.state.model_name, max_model_len=max_model_len)
            for name, lora in self.state.lora_modules.requests.items()])

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        try:
            return await embed_response(self.state, request)
        except PagedServeError as e:
            await context.abort(grpc_code(e), e.message)

    async def Health(self, request, context) -> pb.HealthResponse:
        healthy, reason = await self.state.is_healthy()
        return pb.HealthResponse(ok=healthy, message=reason)

    # --- helpers ----------------------------------------------------------------------
    async def _prepare(self, request: pb.GenerateRequest, arrival: float) -> tuple[GenerationRequest, str]:
        """The generation request, and the text `echo` puts first."""
        state = self.state
        state.check_model(request.model or None)
        params = await with_bad_words_tokenized(state, sampling_params_from_proto(
            request.sampling_params, await state.generator.vocab_size(), state.sampling_defaults,
            await state.generator.max_logprobs()))
        field = request.WhichOneof("prompt")
        echo = ""
        if field in ("text", "token_ids"):
            prompt = request.text if field == "text" else list(request.token_ids.ids)
            add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            prompt_ids, whole = await encoded_prompt(state, prompt, add_special, params)
            echo = echoed_prompt(state, prompt, prompt_ids, whole) if request.echo else ""
        elif field == "chat":
            prompt_ids = await truncated_prompt(state, await self._render_chat(request.chat), params)
            # vLLM's chat echo: the last message when it has the reply's role, which is
            # --response-role's when a new turn opens, else the continued message's own.
            opens_turn = not request.chat.HasField("add_generation_prompt") or request.chat.add_generation_prompt
            last = request.chat.messages[-1]
            echo = last.content if not opens_turn or last.role == state.response_role else ""
        else:
            raise _invalid("a prompt is required: one of text, token_ids or chat", "prompt")
        structured = params.structured_outputs
        await state.generator.validate(prompt_ids, params.max_tokens, min_tokens=params.min_tokens,
                                       prompt_param=field,
                                       structured_output=(structured, STRUCTURED_OUTPUTS_PARAM) if structured else None)
        await state.engine.ensure_connected()
        return GenerationRequest(
            request_id=request.request_id or random_id("grpc-"), prompt_token_ids=prompt_ids,
            sampling_params=params, arrival_time=arrival, priority=request.priority,
            cache_salt=request.cache_salt or None,
            lora_request=state.lora_request(request.model or None)), echo if request.echo else ""

    async def _render_chat(self, chat: pb.ChatMessages) -> list[int]:
        if not chat.messages:
            raise _invalid("chat.messages must not be empty", "chat")
        messages = [{"role": m.role, "content": m.content, **({"name": m.name} if m.name else {}),
                     **({"tool_call_id": m.tool_call_id} if m.tool_call_id else {})} for m in chat.messages]
        add_generation_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
        if chat.continue_final_message and add_generation_prompt:
            raise _invalid("continue_final_message needs add_generation_prompt=false", "chat")
        try:
            return await self.state.tokenizer_client.render_chat(
                messages, add_generation_prompt=add_generation_prompt,
                continue_final_message=chat.continue_final_message,
                chat_template_kwargs=template_kwargs_from_proto(chat.chat_template_kwargs))
        except InvalidRequestError as e:
            e.param = e.param or "chat"
            raise


def template_kwargs_from_proto(struct) -> dict:
    """A protobuf Struct as the dict a template sees. Struct numbers are all doubles:
    a whole one is an int again, as the JSON the client meant (`range(n)` needs one)."""
    def restore(value):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, dict):
            return {key: restore(item) for key, item in value.items()}
        if isinstance(value, list):
            return [restore(item) for item in value]
        return value
    return restore(json_format.MessageToDict(struct))


def _invalid(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


class _Reply:
    """Builds one request's response messages."""

    def __init__(self, request_id: str, texts: TokenTexts, asked: pb.SamplingParams, prompt_token_ids: list[int]):
        self.request_id = request_id
        self.texts = texts
        self.unsent_prompt: list[int] | None = prompt_token_ids  # goes with the first message
        self.show_logprobs = asked.HasField("logprobs")  # best_of asks the engine for them regardless
        self.show_prompt_logprobs = asked.HasField("prompt_logprobs")

    def response(self, index: int, token_ids: list[int], text: str, logprobs: list[TokenLogprobs] | None,
                 finish_reason: str | None, stop_reason: str | int | None,
                 prompt_logprobs: list[TokenLogprobs] | None, usage: GenerationDelta | None) -> pb.GenerateResponse:
        response = pb.GenerateResponse(request_id=self.request_id, token_ids=token_ids, text=text, index=index)
        if self.unsent_prompt is not None:
            response.prompt_token_ids.extend(self.unsent_prompt)
            self.unsent_prompt = None
        if self.show_logprobs and logprobs:
            response.logprobs.extend(self._logprobs(logprobs))
        if self.show_prompt_logprobs and prompt_logprobs is not None:
            response.prompt_logprobs.extend(self._logprobs(prompt_logprobs))
        if finish_reason is not None:
            response.finish_reason = _FINISH_REASONS[finish_reason]
            if isinstance(stop_reason, str):
                response.stop_str = stop_reason
            elif isinstance(stop_reason, int):
                response.stop_token_id = stop_reason
        if usage is not None:
            response.usage.CopyFrom(pb.Usage(
                prompt_tokens=usage.num_prompt_tokens, completion_tokens=usage.num_output_tokens,
                total_tokens=usage.num_prompt_tokens + usage.num_output_tokens,
                cached_tokens=usage.num_cached_tokens))
        return response

    def _logprobs(self, entries: list[TokenLogprobs]) -> list[pb.TokenLogprob]:
        text = self.texts.text
        return [pb.TokenLogprob(token_id=e.token_id, logprob=e.logprob, rank=e.rank, token=text(e.token_id),
                                top_logprobs=[pb.TopLogprob(token_id=t, logprob=lp, token=text(t))
                                              for t, lp in zip(e.top_token_ids, e.top_logprobs)])
                for e in entries]


async def _best_of_responses(reply: _Reply, deltas: AsyncIterator[GenerationDelta], params: SamplingParams,
                             echo: str) -> AsyncIterator[pb.GenerateResponse]:
    """best_of > n: the best samples are known only at the end; one message each."""
    samples = [SampleResult(i) for i in range(params.num_samples)]
    last = prompt_logprobs = None
    async for delta in deltas:
        samples[delta.index].add(delta.decoded())
        last = delta
        prompt_logprobs = delta.prompt_logprobs if delta.prompt_logprobs is not None else prompt_logprobs
    chosen = best_samples(samples, params.n)
    for rank, sample in enumerate(chosen):
        final = rank == len(chosen) - 1
        yield reply.response(rank, sample.token_ids, echo + sample.text, sample.logprobs, sample.finish_reason,
                             sample.stop_reason, prompt_logprobs if rank == 0 else None, last if final else None)


OPEN_METHODS = frozenset({"/pagedserve.v1.PagedServe/Health"})  # like HTTP /health: for probes without the key


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """With --api-key, every call but Health needs `authorization: Bearer <key>` metadata."""

    def __init__(self, api_key: str):
        self.api_key = api_key

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method in OPEN_METHODS:
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        if api_key_matches(metadata.get("authorization"), self.api_key):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        message = AuthenticationError().message

        async def deny_unary(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        async def deny_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # pragma: no cover (makes this an async generator)

        if handler is not None and handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny_stream, handler.request_deserializer,
                                                        handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(deny_unary, handler.request_deserializer if handler else None,
                                                   handler.response_serializer if handler else None)


async def start_grpc_server(state: FrontendState, host: str, port: int, *, api_key: str | None = None,
                            tls_key_pair: tuple[bytes, bytes] | None = None) -> tuple[grpc.aio.Server, int]:
    """Start serving (over TLS with a (private key, certificate chain) PEM pair);
    returns the server and the bound port (useful with port 0)."""
    server = grpc.aio.server(interceptors=[ApiKeyInterceptor(api_key)] if api_key else None,
                             options=GRPC_SERVER_OPTIONS)
    pagedserve_pb2_grpc.add_PagedServeServicer_to_server(PagedServeServicer(state), server)
    credentials = grpc.ssl_server_credentials([tls_key_pair]) if tls_key_pair else None
    bound = bind_grpc_port(server, f"[{host}]:{port}" if ":" in host else f"{host}:{port}", credentials)
    await server.start()
    return server, bound
