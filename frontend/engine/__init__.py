"""The frontend's side of the engine: the clients of the scheduler's sockets
(`engine_client`, `control_client`), the generation loop both APIs share
(`generation`: prompt ids in, text deltas out), beam search over it, and the
frontend's metrics and request log."""
