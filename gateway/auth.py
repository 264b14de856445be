"""API keys: `Authorization: Bearer KEY` on the REST front, the same metadata on gRPC.

Keys come from a file (one per line, `#` comments) and/or an environment variable
(comma-separated). No keys configured means authentication is off. Every configured
key is compared in constant time, and all of them are compared, so response time
reveals neither a key's prefix nor which key matched.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from adaserve.config import GatewaySettings
from gateway.errors import APIError

# Liveness and readiness probes must work without credentials (Kubernetes sends none).
OPEN_PATHS = frozenset({"/health", "/ready"})


class ApiKeys:
    def __init__(self, keys: list[str]) -> None:
        self._keys = [k.encode() for k in dict.fromkeys(keys) if k]

    @classmethod
    def from_settings(cls, gw: GatewaySettings) -> ApiKeys:
        keys: list[str] = []
        if gw.api_keys_file:
            path = Path(gw.api_keys_file)
            if not path.is_file():
                raise FileNotFoundError(f"API keys file not found: {path}")
            for line in path.read_text().splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    keys.append(line)
        keys += [k.strip() for k in os.environ.get(gw.api_keys_env, "").split(",")]
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def valid(self, presented: str) -> bool:
        candidate = presented.encode()
        ok = False
        for key in self._keys:
            ok |= hmac.compare_digest(candidate, key)
        return ok

    def check(self, authorization: str | None) -> None:
        """Raises a 401 APIError unless `authorization` is "Bearer <a configured key>"."""
        if not self.enabled:
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(
                401,
                "missing API key: send 'Authorization: Bearer YOUR_KEY'",
                code="invalid_api_key",
            )
        if not self.valid(token.strip()):
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")

    def requires_auth(self, path: str, metrics_require_auth: bool) -> bool:
        if not self.enabled or path in OPEN_PATHS:
            return False
        return metrics_require_auth or path != "/metrics"
