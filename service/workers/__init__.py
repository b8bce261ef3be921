"""SGLang workers: HTTP client, pool and process launcher."""
