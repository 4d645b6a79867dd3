"""Fetching and verifying model files: the registry of aliases (`resolve_model`, `download`,
`DEFAULT_TARGET`, `DEFAULT_DRAFT`), files checked byte for byte and by sha256 into the cache."""
