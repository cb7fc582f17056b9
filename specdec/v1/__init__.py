"""Generated gRPC stubs (python -m specdec.tools.protogen)."""
