"""The runtime model: `transformer.Transformer` (a pass over ragged rows), paged attention
(`attention`) over the KV pools (`kv_cache`), the architecture's `config.ModelConfig` and the
`tokenizer` with its chat template. Loading a file into one is `specserve.weights.loader`."""
