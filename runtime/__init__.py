"""Keel's behaviour: the server, the runner, the agent loop and the CLI. Nothing imports it."""
