"""Logprobs in the shapes the APIs return: OpenAI's chat object, the legacy
completions object, and vLLM's prompt_logprobs list.

JSON has no -inf, so logprobs are clamped at -9999.0 (as vLLM does).
"""
from __future__ import annotations

from collections.abc import Sequence

from common.protocol import TokenLogprobs
from frontend.engine.token_texts import TokenTexts
from frontend.openai.response_bodies import (ChatChoiceLogprobs, ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs,
                                             PromptLogprobsJSON)

MIN_LOGPROB = -9999.0


def clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def token_label(texts: TokenTexts, token_id: int, as_token_ids: bool) -> str:
    """How a logprobs entry names a token: its text, or with vLLM's return_tokens_as_token_ids
    "token_id:{id}" (exact also for a token that is part of a character, whose text alone is U+FFFD)."""
    return f"token_id:{token_id}" if as_token_ids else texts.text(token_id)


def _label_bytes(texts: TokenTexts, token_id: int, as_token_ids: bool) -> list[int]:
    # As vLLM: with token-id labels the bytes are the label's own.
    return list(token_label(texts, token_id, True).encode()) if as_token_ids else texts.bytes(token_id)


def chat_logprobs(entries: Sequence[TokenLogprobs], texts: TokenTexts,
                  as_token_ids: bool = False) -> ChatChoiceLogprobs:
    """OpenAI's chat `logprobs`: per token, its logprob and the top alternatives
    (as many as the request's top_logprobs)."""
    content = []
    for entry in entries:
        top = [ChatTopLogprob(token=token_label(texts, t, as_token_ids), logprob=clamp(lp),
                              bytes=_label_bytes(texts, t, as_token_ids))
               for t, lp in zip(entry.top_token_ids, entry.top_logprobs)]
        content.append(ChatTokenLogprob(token=token_label(texts, entry.token_id, as_token_ids),
                                        logprob=clamp(entry.logprob),
                                        bytes=_label_bytes(texts, entry.token_id, as_token_ids), top_logprobs=top))
    return ChatChoiceLogprobs(content=content)


def completion_logprobs(token_ids: Sequence[int], entries: Sequence[TokenLogprobs | None], texts: TokenTexts,
                        text_offset: int = 0, as_token_ids: bool = False) -> CompletionLogprobs:
    """The legacy object for `token_ids` (an echoed prompt's first token has
    no entry: None). top_logprobs holds the top alternatives and the chosen
    token ("up to logprobs + 1 elements", as OpenAI documents). text_offset
    always counts the text's characters, also with token-id labels."""
    result = CompletionLogprobs()
    missing = [None] * (len(token_ids) - len(entries))  # not reported (an engine that lost them): no logprob
    for token_id, entry in zip(token_ids, [*entries, *missing]):
        token = token_label(texts, token_id, as_token_ids)
        result.tokens.append(token)
        result.text_offset.append(text_offset)
        text_offset += len(texts.text(token_id))
        if entry is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(clamp(entry.logprob))
        top = {token_label(texts, t, as_token_ids): clamp(lp) for t, lp in zip(entry.top_token_ids, entry.top_logprobs)}
        top.setdefault(token, clamp(entry.logprob))
        result.top_logprobs.append(top)
    return result


def prompt_logprobs_json(entries: Sequence[TokenLogprobs], texts: TokenTexts) -> PromptLogprobsJSON:
    """vLLM's prompt_logprobs: None for the first prompt token, then per token
    {token id: {"logprob", "rank", "decoded_token"}} for it and its top-k."""
    result: PromptLogprobsJSON = [None]
    for entry in entries:
        position = {str(t): {"logprob": clamp(lp), "rank": rank, "decoded_token": texts.text(t)}
                    for rank, (t, lp) in enumerate(zip(entry.top_token_ids, entry.top_logprobs), start=1)}
        position[str(entry.token_id)] = {"logprob": clamp(entry.logprob), "rank": entry.rank,
                                         "decoded_token": texts.text(entry.token_id)}
        result.append(position)
    return result
