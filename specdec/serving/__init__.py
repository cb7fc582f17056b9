"""gRPC serving plumbing: server lifecycle, security, settings, logging, metrics, domain errors."""
