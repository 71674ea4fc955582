"""Prefect tasks: thin wrappers around training/ that add caching, retries and MLflow runs."""
