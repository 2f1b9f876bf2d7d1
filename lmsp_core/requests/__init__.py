"""What a request asks for, checked and turned into what a model runs: the catalog, validation,
extensions, grammars, prompts."""
