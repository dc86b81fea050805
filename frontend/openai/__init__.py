"""The OpenAI-compatible HTTP API: /v1/completions (`serving_completions`),
/v1/chat/completions (`serving_chat`), the Responses API /v1/responses
(`serving_responses` and the `responses_*` modules), /tokenize and
/detokenize (`serving_tokenize`); their request and response bodies
(`request_bodies`, `response_bodies`), logprobs, tool calls and
server-sent events."""
