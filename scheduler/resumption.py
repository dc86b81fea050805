"""Requests a frontend resubmits after losing its scheduler (restarted, or one
that dropped the frontend): each sample's tokens so far come along, and the
request carries on from them as if it had been preempted by recompute. Since
a seeded sample's noise depends on its seed and output position only, and the
worker replays penalties and grammars over the output tokens, the rest of the
output is what it would have been."""
from __future__ import annotations

from common.errors import InvalidRequestError
from common.protocol import EngineRequest, ResumedSample


def resumed_samples(request: EngineRequest, max_model_len: int,
                    vocab_size: int | None) -> dict[int, ResumedSample]:
    """The request's resumed samples by index ({} for a fresh request), checked:
    the same limits as the tokens a running request could have produced."""
    if not request.resumed:
        return {}
    params = request.sampling_params
    num_samples = params.num_samples
    samples: dict[int, ResumedSample] = {}
    room = max_model_len - len(request.prompt_token_ids)
    max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
    for sample in request.resumed:
        if not 0 <= sample.index < num_samples or sample.index in samples:
            raise InvalidRequestError(f"resumed sample index {sample.index} is out of range or repeated "
                                      f"({num_samples} samples)", param="resumed")
        if not sample.finished and len(sample.output_token_ids) >= max_tokens:
            raise InvalidRequestError(f"resumed sample {sample.index} has {len(sample.output_token_ids)} "
                                      f"output tokens, but at most {max_tokens - 1} can precede another",
                                      param="resumed")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in sample.output_token_ids):
            raise InvalidRequestError(f"resumed sample {sample.index} holds a token id out of vocabulary "
                                      f"(size {vocab_size})", param="resumed")
        samples[sample.index] = sample
    if all(index in samples and samples[index].finished for index in range(num_samples)):
        raise InvalidRequestError("every sample of the resumed request has finished already", param="resumed")
    return samples
