"""OpenAI-compatible HTTP server (HTTP/1.1 and h2c HTTP/2 on one port)."""
