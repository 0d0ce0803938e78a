"""Bearer-token check for report pushes, in constant time."""

from __future__ import annotations

import hmac

from pydantic import SecretStr

__all__ = ["authorized"]


def authorized(header: str | None, token: SecretStr | None) -> bool:
    """True when no token is configured, or the Authorization header carries exactly it."""
    if token is None:
        return True
    scheme, _, presented = (header or "").partition(" ")
    # compare_digest on bytes: its time depends on the lengths only, never on where they differ.
    return scheme.lower() == "bearer" and hmac.compare_digest(
        presented.strip().encode(), token.get_secret_value().encode()
    )
