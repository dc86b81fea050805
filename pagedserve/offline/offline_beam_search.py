"""`LLM.beam_search`: vLLM's beam search (`common.beam_search`) in the offline
engine. Every step scores the next token of all live beams of all prompts in
one batch, and each prompt's result is a `GenerationOutput` whose outputs are
its `beam_width` best sequences, best first (their cumulative logprob set)."""
from __future__ import annotations

from typing import Any, Protocol, Sequence

from common.beam_search import BeamSearch, BeamSearchParams
from common.config import EngineConfig
from common.errors import InvalidRequestError
from common.sampling_params import SamplingParams
from pagedserve.offline.offline_outputs import CompletionOutput, GenerationOutput


class BeamEngine(Protocol):
    """What beam search needs of the offline engine (`LLM`): one batched step and the vocabulary."""
    config: EngineConfig
    tokenizer: Any
    eos_token_ids: Sequence[int]
    max_model_len: int

    def generate(self, prompts: Any, sampling_params: SamplingParams,
                 use_tqdm: bool = True) -> list[GenerationOutput]: ...


def run_beam_search(llm: BeamEngine, encoded: Sequence[tuple[str | None, list[int]]],
                    params: BeamSearchParams) -> list[GenerationOutput]:
    params.validate(llm.config.max_logprobs)
    searches = [BeamSearch(params, len(ids), set(llm.eos_token_ids), llm.max_model_len) for _, ids in encoded]
    for search, (_, prompt) in zip(searches, encoded):
        if len(prompt) + search.max_tokens > llm.max_model_len:
            raise InvalidRequestError(f"a {len(prompt)}-token prompt and {search.max_tokens} tokens of beam search "
                                      f"exceed max_model_len {llm.max_model_len}", param="max_tokens")
    step_params = params.step_params()
    while active := [(search, prompt) for search, (_, prompt) in zip(searches, encoded) if not search.done]:
        inputs = [search.next_inputs(prompt_ids) for search, prompt_ids in active]
        results = llm.generate([{"prompt_token_ids": ids} for beams in inputs for ids in beams], step_params,
                               use_tqdm=False)
        start = 0
        for (search, _), beams in zip(active, inputs):
            entries = [result.outputs[0].logprobs[0] for result in results[start:start + len(beams)]]
            search.advance([list(zip(entry.top_token_ids, entry.top_logprobs)) for entry in entries])
            start += len(beams)
    return [_output(llm, str(index), text, prompt, search)
            for index, (search, (text, prompt)) in enumerate(zip(searches, encoded))]


def _output(llm: BeamEngine, request_id: str, text: str | None, prompt: list[int], search: BeamSearch) -> GenerationOutput:
    outputs = []
    for index, beam in enumerate(search.results()):
        token_ids = search.output_token_ids(beam)
        decoded = "" if llm.tokenizer is None else llm.tokenizer.decode(token_ids, skip_special_tokens=True)
        outputs.append(CompletionOutput(index=index, text=decoded, token_ids=token_ids,
                                        finish_reason="stop" if beam.finished_by_eos else "length",
                                        cumulative_logprob=beam.cumulative_logprob))
    return GenerationOutput(request_id=f"beam-{request_id}", prompt=text, prompt_token_ids=list(prompt),
                            outputs=outputs)
