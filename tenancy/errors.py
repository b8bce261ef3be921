"""Domain errors of the tenancy layer; only ``service/api/errors.py`` and the routes turn them into HTTP."""

from __future__ import annotations


class TenantExistsError(Exception):
    """Raised when creating a tenant whose id is taken."""


class TenantNotFoundError(Exception):
    """Raised when a tenant id is unknown (or was deleted while a request was using it)."""


class KeyNotFoundError(Exception):
    """Raised when a key id is unknown (or belongs to another tenant)."""
