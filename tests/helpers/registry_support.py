"""Helpers for the registry and watcher tests: a real `mlflow server` on a free loopback port that a test
may stop and restart (launch/mlflow.py, which `adaptive-spec bench-chaos` runs too); adapters written as the
trainer writes them (adapter_files.py).

    from registry_support import MlflowServer, write_adapter
    server = MlflowServer(tmp_path); server.start(); ...; server.stop(); server.start()   # same port, same db
"""

from __future__ import annotations

from adapter_files import write_adapter  # noqa: F401  (the registry tests take it from here)

from launch.mlflow import MlflowServer  # noqa: F401  (the tests take it from here)
