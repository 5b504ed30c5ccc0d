"""What a figure was measured on: date, device, versions, commit, command.  Stored with every result."""
from __future__ import annotations

import datetime
import importlib.util
import os
import platform
import subprocess
import sys
from typing import Dict, Optional

import torch

# Optional third-party packages whose presence the tools report (import name -> what it is).
PEER_PACKAGES = {
    "flash_mla": "FlashMLA Hopper kernels (pip: sgl-flash-mla)",
    "flashinfer": "FlashInfer (pip: flashinfer-python)",
}


def git_commit(path: Optional[str] = None) -> Optional[str]:
    """The checkout's commit (with ``+dirty`` when files changed), or None outside a git checkout."""
    path = path or os.path.dirname(os.path.abspath(__file__))
    try:
        r = subprocess.run(["git", "rev-parse", "--verify", "-q", "HEAD"], cwd=path, capture_output=True, text=True,
                           timeout=5)
        sha = r.stdout.strip()
        if r.returncode != 0 or len(sha) != 40:
            return None  # not a checkout, or one with no commit yet
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=path,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except Exception:
        return None


def _version(mod: str) -> Optional[str]:
    try:
        m = __import__(mod)
        return str(getattr(m, "__version__", "installed"))
    except Exception:
        return None


def installed_peers() -> Dict[str, Optional[str]]:
    """{import name: version string or None when not importable} for :data:`PEER_PACKAGES`.

    Only looks for the package (no import) first: a broken optional package must not break ``info``.
    """
    out = {}
    for name in PEER_PACKAGES:
        if importlib.util.find_spec(name) is None:
            out[name] = None
        else:
            out[name] = _version(name) or "present (import failed)"
    return out


def device_info(device=None) -> Dict[str, object]:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type != "cuda":
        return {"device": "cpu", "name": platform.processor() or platform.machine(), "cuda": False,
                "cpu_count": os.cpu_count()}
    p = torch.cuda.get_device_properties(device)
    return {"device": str(device), "name": p.name, "cuda": True,
            "compute_capability": f"{p.major}.{p.minor}", "sm_count": p.multi_processor_count,
            "memory_gib": round(p.total_memory / 2 ** 30, 1),
            "l2_mib": round(getattr(p, "L2_cache_size", 0) / 2 ** 20, 1)}


def environment(device=None) -> Dict[str, object]:
    """Everything needed to reproduce a figure."""
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "triton": _version("triton"),
        "sparsemla_commit": git_commit(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
        "peers": installed_peers(),
        **device_info(device),
    }


__all__ = ["environment", "device_info", "installed_peers", "git_commit", "PEER_PACKAGES"]
