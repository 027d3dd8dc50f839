"""`conveyor operator`: run the kopf operator with conveyor's handlers and settings.

Watches one or more namespaces (`--namespace`, repeatable) or the whole cluster (`--all-namespaces`,
the default). `--standalone` turns off kopf's peering, which otherwise lets several operator replicas
agree on one active instance through a (Cluster)KopfPeering object.
"""

from __future__ import annotations

import argparse
import logging
import sys

import kopf


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface of `conveyor operator`."""
    parser = argparse.ArgumentParser(
        prog="conveyor operator",
        description="Reconcile InferenceService resources into GPU Deployments of `conveyor serve`.",
    )
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        help="watch this namespace (repeatable; glob patterns allowed)",
    )
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace (default)")
    peering = parser.add_mutually_exclusive_group()
    peering.add_argument(
        "--standalone", action="store_true", help="run without peering (one operator replica)"
    )
    peering.add_argument(
        "--peering",
        metavar="NAME",
        default=None,
        help="peering object name shared by operator replicas (default: kopf's)",
    )
    parser.add_argument("--priority", type=int, default=0, help="peering priority of this replica")
    parser.add_argument(
        "--liveness",
        metavar="URL",
        default=None,
        help="serve a liveness endpoint, e.g. http://0.0.0.0:8080/healthz",
    )
    parser.add_argument("--verbose", "-v", action="store_true", help="debug logging")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the operator until interrupted; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # Importing registers the handlers with kopf's default registry.
    import conveyor.operator.handlers  # noqa: F401

    namespaces = list(args.namespace)
    kopf.run(
        standalone=args.standalone,
        priority=args.priority,
        peering_name=args.peering,
        liveness_endpoint=args.liveness,
        clusterwide=not namespaces,
        namespaces=namespaces,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
