"""`performer-hf env`: versions, device, threads and whether the Hub answers (paste it into bug reports)."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from importlib import metadata

NAME = "env"
HELP = "print versions, device, threads and Hub reachability"

PACKAGES = ("performer-hf", "torch", "transformers", "datasets", "accelerate", "evaluate", "huggingface_hub",
            "safetensors", "tokenizers")


@dataclass
class Args:
    timeout: float = field(default=3.0, metadata={"help": "seconds to wait for the Hub"})


def redact_url(url: str) -> str:
    """`url` with any user name, password and query string replaced by ***, for printing."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
    except ValueError:
        return "***"
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    return urlunsplit((parts.scheme, netloc, parts.path, "***" if parts.query else "", ""))


def hub_status(timeout: float) -> str:
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "offline mode (HF_HUB_OFFLINE=1)"
    endpoint = constants.ENDPOINT
    shown = redact_url(endpoint)  # HF_ENDPOINT may carry credentials: never print them
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(f"{endpoint}/api/models?limit=1", method="HEAD"),
                                    timeout=timeout) as response:
            return f"reachable ({shown}, HTTP {response.status})"
    except urllib.error.HTTPError as err:  # it answered
        return f"reachable ({shown}, HTTP {err.code})"
    except (OSError, ValueError) as err:  # no route, DNS, timeout, bad endpoint
        reason = str(getattr(err, "reason", err)).replace(endpoint, shown)
        reason = type(err).__name__ if "@" in reason else reason
        return f"not reachable ({shown}: {reason})"


def run(args: Args) -> int:
    import torch

    rows = [(name, _version(name)) for name in PACKAGES]
    rows += [
        ("python", platform.python_version()),
        ("platform", platform.platform()),
        ("device", _device(torch)),
        ("torch threads", str(torch.get_num_threads())),
        ("cpu cores", str(os.cpu_count())),
        ("hub", hub_status(args.timeout)),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _device(torch) -> str:
    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        return f"cuda ({torch.cuda.device_count()}: {names})"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps"
    return "cpu"
