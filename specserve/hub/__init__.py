"""Where models come from: the registry of aliases (`registry`: `download`, `DEFAULT_TARGET`,
`DEFAULT_DRAFT`, files checked byte for byte and by sha256 into the cache), Hugging Face Hub
ids (`huggingface`), and the one resolver of every model name (`resolver.resolve_model`)."""
