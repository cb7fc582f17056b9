"""Coordinator: the public gRPC API; drives sessions across the draft and target workers."""
