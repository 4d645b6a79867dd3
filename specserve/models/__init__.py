"""The runtime model: `transformer.Transformer` (a pass over ragged rows) and, for Qwen3.5 and
Gemma 4, `hybrid.HybridModel` (Gated DeltaNet layers with per-sequence `recurrent_state`, hybrid
attention, the `mtp_head`), built by `factory.build_model`; paged attention (`attention`) over
the KV pools (`kv_cache`), the architecture's `config.ModelConfig` and the `tokenizer` with its
chat template. Loading a file into one is `specserve.weights.loader`."""
