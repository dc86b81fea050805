"""The request extras the frontend resolves before a request leaves it:
bad_words become token ids (in the tokenizer pool, where the tokenizer is),
and truncate_prompt_tokens cuts the tokenized prompt. Both HTTP APIs and
gRPC call these, after the prompt is tokenized and before its length is
checked."""
from __future__ import annotations

import asyncio

import msgspec

from common.bad_words import bad_words_token_ids, spellings
from common.prompt_truncation import truncate_prompt
from common.sampling_params import SamplingParams
from frontend.frontend_state import FrontendState


async def with_bad_words_tokenized(state: FrontendState, params: SamplingParams) -> SamplingParams:
    """`params` with bad_words_token_ids filled in (checked against the model's vocabulary)."""
    if not params.bad_words:
        return params
    encode = state.tokenizer_client.encode
    encoded = await asyncio.gather(*(
        asyncio.gather(*(encode(text, add_special_tokens=False) for text in spellings(word)))
        for word in params.bad_words))
    ids = bad_words_token_ids(params.bad_words, [(plain, spaced) for plain, spaced in encoded])
    params = msgspec.structs.replace(params, bad_words_token_ids=ids)
    return params.validate(await state.generator.vocab_size(), await state.generator.max_logprobs())


async def truncated_prompt(state: FrontendState, token_ids: list[int], params: SamplingParams) -> list[int]:
    """The prompt that runs: its last truncate_prompt_tokens tokens, when asked."""
    if params.truncate_prompt_tokens is None:
        return token_ids
    return truncate_prompt(token_ids, params.truncate_prompt_tokens, await state.max_model_len())


async def encoded_prompt(state: FrontendState, prompt: str | list[int], add_special_tokens: bool,
                         params: SamplingParams) -> tuple[list[int], bool]:
    """A text or token-id prompt's ids that run (truncated when asked), and whether
    they are the whole prompt."""
    if isinstance(prompt, str):
        ids = await state.tokenizer_client.encode(prompt, add_special_tokens=add_special_tokens)
    else:
        ids = list(prompt)
    kept = await truncated_prompt(state, ids, params)
    return kept, len(kept) == len(ids)


def echoed_prompt(state: FrontendState, prompt: str | list[int], token_ids: list[int], whole: bool) -> str:
    """The prompt as echoed: the client's text, unless truncation cut it (then the text of what ran)."""
    return prompt if isinstance(prompt, str) and whole else state.tokenizer.decode(token_ids)
