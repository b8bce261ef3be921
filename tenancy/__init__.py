"""Tenants, API keys, quotas and usage, stored in Redis."""
