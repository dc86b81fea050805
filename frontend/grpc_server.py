"""The client gRPC API (proto/pagedserve.proto) on grpc.aio, sharing the
frontend's engine client, tokenizer and generator with the HTTP API.

Bad input answers INVALID_ARGUMENT (NOT_FOUND for an unknown model,
UNAVAILABLE when the engine is down); a cancelled Generate stream aborts
its request in the scheduler.
"""
from __future__ import annotations

import time
from contextlib import aclosing

import grpc

from common.errors import InvalidRequestError, PagedServeError
from common.grpc_gen import pagedserve_pb2 as pb
from common.grpc_gen import pagedserve_pb2_grpc
from common.sampling_params import SamplingParams
from frontend.errors import grpc_code
from frontend.generation import GenerationDelta, GenerationRequest
from frontend.state import FrontendState, random_id

_FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
                   "abort": pb.FINISH_REASON_ABORT}


def sampling_params_from_proto(message: pb.SamplingParams) -> SamplingParams:
    """Unset optional fields keep SamplingParams' defaults; max_tokens unset
    means "as many as fit in the context"."""
    defaults = SamplingParams()

    def get(name: str, default):
        return getattr(message, name) if message.HasField(name) else default

    return SamplingParams(
        temperature=get("temperature", defaults.temperature), top_p=get("top_p", defaults.top_p),
        top_k=get("top_k", defaults.top_k), min_p=get("min_p", defaults.min_p), seed=get("seed", None),
        max_tokens=get("max_tokens", None), min_tokens=message.min_tokens, ignore_eos=message.ignore_eos,
        stop_token_ids=list(message.stop_token_ids)).validate()


class PagedServeServicer(pagedserve_pb2_grpc.PagedServeServicer):
    def __init__(self, state: FrontendState):
        self.state = state

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        arrival = time.monotonic()
        try:
            generation = await self._prepare(request, arrival)
        except PagedServeError as e:
            await context.abort(grpc_code(e), e.message)
        # A cancelled RPC cancels this task; closing the deltas aborts the request.
        async with aclosing(self.state.generator.generate(generation)) as deltas:
            try:
                async for delta in deltas:
                    yield _response(generation.request_id, delta)
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

    async def ListModels(self, request, context) -> pb.ListModelsResponse:
        max_model_len = await self.state.max_model_len() or 0
        return pb.ListModelsResponse(models=[
            pb.Model(id=name, owned_by="pagedserve", created=self.state.created, root=self.state.model_root,
                     max_model_len=max_model_len) for name in self.state.served_model_names])

    async def Health(self, request, context) -> pb.HealthResponse:
        healthy, reason = await self.state.is_healthy()
        return pb.HealthResponse(ok=healthy, message=reason)

    # --- helpers ----------------------------------------------------------------------
    async def _prepare(self, request: pb.GenerateRequest, arrival: float) -> GenerationRequest:
        state = self.state
        state.check_model(request.model or None)
        params = sampling_params_from_proto(request.sampling_params)
        field = request.WhichOneof("prompt")
        if field == "text":
            add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            prompt_ids = await state.tokenizer_client.encode(request.text, add_special_tokens=add_special)
        elif field == "token_ids":
            prompt_ids = list(request.token_ids.ids)
        elif field == "chat":
            prompt_ids = await self._render_chat(request.chat)
        else:
            raise _invalid("a prompt is required: one of text, token_ids or chat", "prompt")
        await state.generator.validate(prompt_ids, params.max_tokens, prompt_param=field)
        await state.engine.ensure_connected()
        skip_special = (request.sampling_params.skip_special_tokens
                        if request.sampling_params.HasField("skip_special_tokens") else True)
        return GenerationRequest(
            request_id=request.request_id or random_id("grpc"), prompt_token_ids=prompt_ids,
            sampling_params=params, stop=list(request.sampling_params.stop),
            include_stop_str_in_output=request.sampling_params.include_stop_str_in_output,
            skip_special_tokens=skip_special, arrival_time=arrival, priority=request.priority,
            cache_salt=request.cache_salt or None)

    async def _render_chat(self, chat: pb.ChatMessages) -> list[int]:
        if not chat.messages:
            raise _invalid("chat.messages must not be empty", "chat")
        messages = [{"role": m.role, "content": m.content, **({"name": m.name} if m.name else {})}
                    for m in chat.messages]
        add_generation_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
        if chat.continue_final_message and add_generation_prompt:
            raise _invalid("continue_final_message needs add_generation_prompt=false", "chat")
        return await self.state.tokenizer_client.render_chat(
            messages, add_generation_prompt=add_generation_prompt,
            continue_final_message=chat.continue_final_message)


def _invalid(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def _response(request_id: str, delta: GenerationDelta) -> pb.GenerateResponse:
    response = pb.GenerateResponse(request_id=request_id, token_ids=delta.token_ids, text=delta.text)
    if delta.finish_reason is not None:
        response.finish_reason = _FINISH_REASONS[delta.finish_reason]
        if isinstance(delta.stop_reason, str):
            response.stop_str = delta.stop_reason
        elif isinstance(delta.stop_reason, int):
            response.stop_token_id = delta.stop_reason
        response.usage.CopyFrom(pb.Usage(
            prompt_tokens=delta.num_prompt_tokens, completion_tokens=delta.num_output_tokens,
            total_tokens=delta.num_prompt_tokens + delta.num_output_tokens,
            cached_tokens=delta.num_cached_tokens))
    return response


async def start_grpc_server(state: FrontendState, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Start serving; returns the server and the bound port (useful with port 0)."""
    server = grpc.aio.server()
    pagedserve_pb2_grpc.add_PagedServeServicer_to_server(PagedServeServicer(state), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"cannot bind the gRPC API to {host}:{port}")
    await server.start()
    return server, bound
