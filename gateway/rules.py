"""The rules the gateway itself applies: a cached answer must pass the output rules in force
before it is replayed, and the audit trail masks the values that rules say to mask.

A gateway loads the same rules directory as its engines (`FINSIEVE_RULES`, `--rules`) and
hot-reloads it the same way. It needs no model and no token tables: the pack alone. When
its policy version differs from the one an engine announces, the cache is not used (a
miss) until both agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from finsieve.policy.pack import Pack
from finsieve.policy.sources import DEFAULT_LIMITS, PackLimits

from .sensitive import Sensitive


@dataclass(frozen=True)
class GatewayPolicy:
    pack: Pack
    sensitive: Sensitive

    @property
    def version(self) -> str:
        return self.pack.version


def compile_gateway_policy(directory: Path, key: bytes,
                           limits: PackLimits = DEFAULT_LIMITS) -> tuple[GatewayPolicy, str]:
    """Load a rules directory (raises schema.PackError); `key` is the audit key."""
    pack = Pack.load(directory, limits)
    return GatewayPolicy(pack, Sensitive(pack, key)), pack.version
