"""HTTP load generator for OpenAI-compatible servers (`python -m loadtest --help`)."""
