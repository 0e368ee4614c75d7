"""The inference engine: model families, weight loading, paged KV cache, expert execution, sampling."""
