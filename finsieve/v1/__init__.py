"""Generated gRPC stubs of proto/finsieve/v1 (built by `make proto`, never edited)."""
