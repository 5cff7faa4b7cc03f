"""Loopback servers: a real model server and a fault-injecting one."""
