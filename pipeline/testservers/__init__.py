"""Servers for tests, benchmarks and fault drills: ``fault`` answers like an OpenAI-compatible
server that is slow, fails, truncates or refuses on purpose. The real servers' supervisors are in
``pipeline.servers``; the demo's model server is in ``pipeline.demo``."""
