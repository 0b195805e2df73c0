"""The router's settings, apart from the proxy so that parsing its flags imports no web stack."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve_server.router.policy import PolicyArgs


@dataclass
class RouterArgs:
    worker_urls: list[str]
    policy: PolicyArgs = field(default_factory=PolicyArgs)
    health_check_interval_secs: float = 10.0
    health_check_timeout_secs: float = 5.0
    health_failure_threshold: int = 3
    health_success_threshold: int = 2
    worker_startup_timeout_secs: float = 300.0
    request_timeout_secs: float = 1800.0
    max_payload_size: int = 32 * 2**20
