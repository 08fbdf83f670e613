"""Inference layer: embedded engine, HTTP engine server, router, client, shard fleet."""
