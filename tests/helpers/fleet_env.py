"""What a fleet's processes get from the environment, as tests/reliability/test_fleet.py runs them.

ops/compose.yaml and ops/k8s/adaptive-spec.yaml must give every replica and the trainer the same
names, and probe the same health path; tests/ops/test_ops_files.py checks that they do.
"""

from __future__ import annotations

# Every `adaptive-spec serve` replica: the shared Redis and MLflow, the two tokens, the alias poll.
FLEET_SERVE_ENV = (
    "REDIS_URL",
    "MLFLOW_TRACKING_URI",
    "ADAPTIVE_SPEC_ADMIN_TOKEN",
    "ADAPTIVE_SPEC_API_KEY",
    "ADAPTIVE_SPEC_ADAPTER_POLL_S",
)
# The one `adaptive-spec train`: the stream it consumes and the registry it promotes into.
FLEET_TRAIN_ENV = ("REDIS_URL", "MLFLOW_TRACKING_URI")
FLEET_ADAPTER_POLL_S = "5"  # the default: pub/sub wakes a replica at once, the poll is the fallback
HEALTH_PATH = "/health"  # readiness of a replica: 200 once its models are loaded
