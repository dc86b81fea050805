"""The gRPC API (proto/pagedserve.proto), served beside the HTTP API."""
