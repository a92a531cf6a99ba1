"""The serving engine: KV cache and block allocator, scheduler, model runner, sampler."""
