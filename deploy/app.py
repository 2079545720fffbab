"""`serve run deploy.app:specextend` (no arguments: the default model pair),
`serve run deploy.app:specextend target=random:llama-tiny draft=random:llama-tiny-draft num_gpus=0`,
or a Serve YAML config with `import_path: deploy.app:specextend` and `args:`.

Arguments are the flat names of specextend's configuration (specextend/config.py); a bad one fails
here, before anything is deployed, with the field named. So do a draft that does not speak the
target's token ids ("tokenizer mismatch: ...") and asking for GPUs the cluster cannot have
(instead of replicas pending forever).
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import ray
from ray.serve import Application

from specextend.builder import check_specs
from specextend.serving.app import build_app
from specextend.serving.settings import AppSettings, check_cluster_gpus, check_gpus


def _fresh_local_gpus() -> Optional[int]:
    """GPUs of the local Ray instance that `serve run` (no address) is about to start; None when
    it will connect to a cluster instead, or this is not `serve run` (the ingress checks then)."""
    argv = sys.argv
    if os.path.basename(argv[0]) != "serve" or argv[1:2] != ["run"]:
        return None
    if any(a in ("-a", "--address") or a.startswith("--address=") for a in argv):
        return None
    from ray._private.services import canonicalize_bootstrap_address

    if canonicalize_bootstrap_address(None) is not None:  # RAY_ADDRESS or a running `ray start`
        return None
    import torch

    return torch.cuda.device_count()


def specextend(args: dict) -> Application:
    settings = args if isinstance(args, AppSettings) else AppSettings.model_validate(dict(args or {}))
    check_specs(settings.to_engine_config())  # a mismatched pair fails here, before deploying
    if ray.is_initialized():  # Serve's build task (YAML, KubeRay), or a script after ray.init()
        check_cluster_gpus(settings)
    elif (local := _fresh_local_gpus()) is not None:
        check_gpus(settings, [float(local)], None)
    return build_app(settings)
