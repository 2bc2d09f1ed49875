"""`adaptive-spec adapters list|rollback|promote|export|import`: the adapter registry from the terminal
(registry/client.py).

adaptive-spec adapters list --json
adaptive-spec adapters rollback --to 3
adaptive-spec adapters promote 4
adaptive-spec adapters promote 4 --domain sql     # champion-sql <- 4: requests tagged "sql" draft with it
adaptive-spec adapters list --domain sql          # sql's versions and aliases only
adaptive-spec adapters export 7 ./head-v7         # an eagle3 version as a speculators checkpoint (adapters_eagle3.py)
adaptive-spec adapters import ./head --promote    # an EAGLE-3 checkpoint as a new version, champion

Without --domain a command acts on the general adapter (`champion`, `previous`); with it, on that
domain's pair (`champion-sql`, `previous-sql`). A domain name is letters, digits, '_' and inner '-'.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from adaptive_spec.contracts import (
    ACTION_TAG,
    MODEL_NAME,
    REDIS_URL_ENV,
    champion_alias,
    check_domain,
    previous_alias,
)
from cli import adapters_eagle3
from cli.options import use_data_dir


def domain_name(text: str) -> str:
    """--domain: a name an alias can carry (adaptive_spec/contracts.py `check_domain`), else exit 2."""
    try:
        return check_domain(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_commands(commands) -> None:
    adapters = commands.add_parser(
        "adapters",
        help="the adapter registry: list, rollback, promote, export, import",
        description="The draft's adapters in MLflow (MLFLOW_TRACKING_URI, else DATA_DIR/mlflow.db). Servers follow "
        "the 'champion' alias (the general adapter) and each domain's 'champion-DOMAIN' within seconds. Rollbacks "
        "and promotions are recorded with who made them. EAGLE-3 heads (the eagle3 draft) leave as standard "
        "checkpoints that vLLM and SGLang load (export) and come in from them, trained anywhere (import).",
    )
    store = argparse.ArgumentParser(add_help=False)
    store.add_argument(
        "--data-dir", type=Path, default=None, help="default: $ADAPTIVE_SPEC_DATA_DIR or ./.adaptive-spec"
    )
    store.add_argument("--registered-model", default=None, help=f"default: {MODEL_NAME}")
    where = argparse.ArgumentParser(add_help=False, parents=[store])
    where.add_argument(
        "--domain",
        type=domain_name,
        default=None,
        metavar="NAME",
        help="act on one domain's adapter (aliases champion-NAME, previous-NAME); default: the general adapter",
    )
    actions = adapters.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = actions.add_parser(
        "list",
        parents=[where],
        help="versions with their domain, created time, gate figures and aliases (--domain: that domain's only)",
    )
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    back = actions.add_parser("rollback", parents=[where], help="champion <- previous, or <- --to VERSION")
    back.add_argument("--to", default=None, metavar="VERSION")
    forward = actions.add_parser("promote", parents=[where], help="champion <- VERSION, previous <- the old champion")
    forward.add_argument("version", metavar="VERSION")
    adapters_eagle3.add_commands(actions, store, where)
    adapters.set_defaults(func=cmd_adapters)


def cmd_adapters(args) -> int:
    from adaptive_spec.models import data_dir
    from registry.client import AdapterRegistry, RegistryUnavailable, actor

    transfer = args.action in adapters_eagle3.ACTIONS
    if transfer:
        use_data_dir(args.data_dir)  # import converts the target's GGUF under it, as the other commands do
    registry = AdapterRegistry(
        data_dir=args.data_dir or data_dir(),
        redis_url=os.environ.get(REDIS_URL_ENV),
        model_name=args.registered_model or MODEL_NAME,
        signing_key=adapters_eagle3.signing_key() if transfer else None,  # export checks it, import signs with it
    )
    try:
        if args.action == "export":
            print(adapters_eagle3.export_version(registry, args))
            return 0
        if args.action == "import":
            version = adapters_eagle3.import_checkpoint(registry, args)
            if not args.promote:
                return 0
            event = registry.promote(version, by=actor("cli"), domain=args.domain)
        elif args.action == "list":
            versions = registry.versions()
            if args.domain is not None:
                versions = _of_domain(versions, args.domain)
            if args.json:
                print(json.dumps([v.as_dict() for v in versions], indent=2))
            else:
                print(_adapter_table(versions) if versions else f"no versions of {registry.model_name} in {registry!r}")
            return 0
        elif args.action == "rollback":
            event = registry.rollback(to=args.to, by=actor("cli"), domain=args.domain)
        else:
            event = registry.promote(args.version, by=actor("cli"), domain=args.domain)
    except RegistryUnavailable as exc:
        print(f"adaptive-spec: error: {exc}", file=sys.stderr)
        return 3
    finally:
        registry.close()
    print(describe_move(event, args.domain))
    return 0


def describe_move(event: dict, domain: str | None) -> str:
    """What a promote or rollback did, from its event and the aliases it read back under the alias lock:
    "rollback: champion 5 -> 4 (by cli:alice@host); previous none"."""
    champion, previous = champion_alias(domain), previous_alias(domain)
    moved = (
        f"{event['from'] or 'none'} -> {event['version']}" if event.get("changed") else f"already {event['version']}"
    )
    line = f"{event['event']}: {champion} {moved} (by {event['by']})"
    after = event.get("aliases")
    if after is None:
        return line
    line += f"; {previous} {after.get(previous) or 'none'}"
    if after.get(champion) != event["version"]:
        line += f"; but {champion} is now {after.get(champion) or 'none'} (moved outside adaptive-spec meanwhile)"
    return line


def _of_domain(versions, domain: str) -> list:
    """The versions trained for `domain` or holding one of its aliases, with only its aliases."""
    from registry.records import domain_aliases

    names = domain_aliases(domain)
    kept = [dataclasses.replace(v, aliases=tuple(a for a in v.aliases if a in names)) for v in versions]
    return [v for v in kept if v.domain == domain or v.aliases]


def _adapter_table(versions) -> str:
    def figure(value):
        return "-" if value is None else f"{value:.3f}"

    rows = [("VERSION", "DOMAIN", "CREATED", "GATE MATCH", "CHAMPION MATCH", "LOSS", "ALIASES", "LAST ACTION")]
    for v in versions:
        action = v.tags.get(ACTION_TAG)
        alias = v.tags.get(ACTION_TAG + "_alias")
        rows.append(
            (
                v.version,
                v.domain or "-",
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(v.created_at)),
                figure(v.candidate_greedy_match),
                figure(v.champion_greedy_match),
                figure(v.loss),
                ",".join(v.aliases) or "-",
                f"{action}{f' {alias}' if alias else ''} by {v.tags.get(ACTION_TAG + '_by')}" if action else "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]  # every row has every column
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    )
