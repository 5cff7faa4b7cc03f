"""The embedded default: a tiny real target built offline, its server, and a whole-pipeline run."""
