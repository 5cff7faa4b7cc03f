"""Loopback servers: a real model server, a fault-injecting one, and how to start them."""
