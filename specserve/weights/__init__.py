"""Model files and what becomes of their weights: the GGUF reader (`gguf_file`), the GGUF and
Hugging Face loaders (`gguf_loader`, `hf_loader`), dequantization (`dequant`), the native
kernels' quantized layouts (`quant`), the cache of repacked weights (`weight_cache`), and
`loader.load_model`, which builds a runtime model (`specserve.models`) from a file."""
