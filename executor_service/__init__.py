"""The executor service: model weights, paged KV cache, attention backends and sampling."""
