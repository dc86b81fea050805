"""The frontend process: `frontend_cli` starts the OpenAI-compatible HTTP API
(`api_server`, routes in `openai/`) and the gRPC API (`grpc/`) over one
`FrontendState` (`frontend_state`), which talks to the scheduler through
`engine/`. `tool_parsers/` finds tool calls in model text."""
