"""Engine flags: prefill-decode disaggregation (SGLang's names), docs/usage.md
"Prefill-decode disaggregation"."""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.config.common import Checks, flag, json_object
from radixserve.flags import ConfigError

DISAGGREGATION_MODES = ("null", "prefill", "decode")


@dataclass
class DisaggregationArgs(Checks):
    disaggregation_mode: str = flag(
        "null",
        "null: prefill and decode here; prefill: compute prompts and send their KV to the decode server "
        "of each request's bootstrap room; decode: receive the KV of prompts prefilled elsewhere, then "
        "decode",
        choices=DISAGGREGATION_MODES,
    )
    disaggregation_transfer_backend: str = flag("mooncake", "KV transfer engine between the prefill and decode servers")
    disaggregation_bootstrap_port: int = flag(
        8998,
        "prefill servers: the port of the bootstrap endpoint decode servers register their requests' KV "
        "destinations at (requests name it as bootstrap_port)",
    )
    disaggregation_ib_device: str | None = flag(
        None,
        "RDMA NIC(s) the transfer engine uses, comma-separated (unused over TCP)",
    )
    disaggregation_host: str = flag(
        "127.0.0.1",
        "radixserve: the address this server's bootstrap endpoint and transfer engine listen at and "
        "give to peers",
    )
    disaggregation_transfer_timeout: float = flag(
        30.0,
        "seconds a request's KV may take to arrive: a decode request still waiting fails with a 503, a "
        "prefill server frees pages nobody registered for or that could not be sent",
    )
    disaggregation_transfer_backend_extra_config: str | None = flag(
        None,
        "radixserve: a JSON object of the transfer engine's own options",
    )

    def check_disaggregation(self) -> None:
        self._check_name("disaggregation_transfer_backend", "a backend name")
        self._check_int("disaggregation_bootstrap_port", minimum=1)
        if self.disaggregation_bootstrap_port > 65535:
            raise ConfigError(f"--disaggregation-bootstrap-port must be <= 65535, got "
                              f"{self.disaggregation_bootstrap_port}")
        self._check_name("disaggregation_ib_device", "NIC names")
        self._check_name("disaggregation_host", "a host name or address")
        self._check_seconds("disaggregation_transfer_timeout")
        self.transfer_extra_config()

    def transfer_extra_config(self) -> dict:
        raw = self.disaggregation_transfer_backend_extra_config
        return {} if raw is None else json_object(raw, "--disaggregation-transfer-backend-extra-config")
