"""An OpenAI-compatible HTTP server: `pagedllm serve`."""
