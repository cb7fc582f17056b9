"""Generated gRPC stubs (python -m specdec.protogen)."""
