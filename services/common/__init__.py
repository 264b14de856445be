"""What every adaserve gRPC service and client shares: options, bootstrap, conversion."""
