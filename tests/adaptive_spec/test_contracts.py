"""The names shared across processes are DESIGN.md's, and the helpers that build names follow them.

.venv/bin/python -m pytest tests/adaptive_spec/test_contracts.py -q
"""

from __future__ import annotations

import pytest

from adaptive_spec import contracts


def test_the_names_are_the_design_contract():
    assert contracts.CORRECTION_STREAM == "adaptive_spec:corrections"
    assert contracts.ADAPTER_EVENTS == "adaptive_spec:adapters"
    assert contracts.EXPERIMENT == "adaptive-spec"
    assert contracts.MODEL_NAME == "adaptive-spec-draft"
    assert (contracts.CHAMPION, contracts.PREVIOUS) == ("champion", "previous")
    assert (contracts.REDIS_URL_ENV, contracts.MLFLOW_TRACKING_URI_ENV) == ("REDIS_URL", "MLFLOW_TRACKING_URI")
    assert contracts.DATA_DIR_ENV.startswith(contracts.ENV_PREFIX) and contracts.ENV_PREFIX == "ADAPTIVE_SPEC_"


def test_per_domain_aliases_name_their_domain():
    assert contracts.champion_alias() == "champion" and contracts.previous_alias() == "previous"
    assert contracts.champion_alias("sql") == "champion-sql"
    assert contracts.previous_alias("json_extraction") == "previous-json_extraction"
    for bad in ("", "a b", "-sql", "sql:1", "x/y"):
        with pytest.raises(ValueError, match="domain"):
            contracts.champion_alias(bad)


def test_directory_and_key_names():
    assert contracts.version_dir_name(3) == "v0003"
    assert contracts.cache_dir_name("12", "9f2c0123abcdef") == "v12-9f2c0123abcd"
    assert contracts.stats_bucket_key(60, 1_700_000_040) == "adaptive_spec:stats:b:60:1700000040"
    assert contracts.sqlite_tracking_uri("/srv/as") == "sqlite:////srv/as/mlflow.db"


@pytest.mark.parametrize(
    "url, shown",
    [
        ("redis://:secret@host:6379/0", "redis://***@host:6379/0"),
        ("http://alice:pw@mlflow:5000", "http://***@mlflow:5000"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("sqlite:///tmp/mlflow.db", "sqlite:///tmp/mlflow.db"),
    ],
)
def test_redact_url_hides_credentials_only(url, shown):
    assert contracts.redact_url(url) == shown
