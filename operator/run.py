"""`conveyor operator`: run the kopf operator with conveyor's handlers and settings.

Watches one or more namespaces (`--namespace`, repeatable) or the whole cluster (`--all-namespaces`,
the default). `--standalone` turns off kopf's peering, which otherwise lets several operator replicas
agree on one active instance through a (Cluster)KopfPeering object.

Before it watches anything it asks the API server whether its identity holds every permission it needs
(operator/permissions.py, the list the chart's ClusterRole is generated from) and exits with status 1,
naming each missing verb and resource, when one is missing.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import math
import os
import random
import re
import signal
import sys
from typing import TYPE_CHECKING, Any

import kopf
import prometheus_client

from conveyor.operator.render import KedaSettings
from conveyor.operator.spec import DEFAULT_IMAGE, DNS1123_SUBDOMAIN, LABEL_KEY, LABEL_VALUE

if TYPE_CHECKING:
    from conveyor.operator.memo import OperatorMemo


# What some flags' values must match, and their defaults: the chart's values take theirs from these
# (operator/chart.py), so that a value the schema admits is one the operator accepts.
URL_PATTERN = r"https?://[^/\s]+"
KEDA_AUTH_MODES = r"(bearer|basic|tls|custom)(,(bearer|basic|tls|custom))*"
AUTOSCALE_INTERVAL_SECONDS = 15
METRICS_PORT = 8081
KEDA_POLLING_INTERVAL_SECONDS = 15


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
        type=_name,
        default=None,
        help="peering object name shared by operator replicas (default: kopf's)",
    )
    parser.add_argument(
        "--priority",
        type=_priority,
        default=0,
        help="peering priority of this replica: the highest live one acts; 'random' draws one at start, so "
        "that replicas of one Deployment differ (kopf pauses every replica while two share a priority)",
    )
    parser.add_argument(
        "--liveness",
        metavar="URL",
        default=None,
        help="serve a liveness endpoint, e.g. http://0.0.0.0:8080/healthz",
    )
    parser.add_argument(
        "--prometheus-url",
        metavar="URL",
        default=os.environ.get("CONVEYOR_PROMETHEUS_URL"),
        type=_url,
        help="Prometheus server the builtin autoscaler queries (env CONVEYOR_PROMETHEUS_URL); "
        "without it autoscaled resources hold their replicas with MetricsAvailable=False",
    )
    parser.add_argument(
        "--autoscale-interval",
        metavar="SECONDS",
        type=_positive_seconds,
        default=AUTOSCALE_INTERVAL_SECONDS,
        help=f"seconds between two builtin-autoscaler steps of one InferenceService (default "
        f"{AUTOSCALE_INTERVAL_SECONDS})",
    )
    parser.add_argument(
        "--metrics-port",
        type=_port,
        default=METRICS_PORT,
        help=f"port of the operator's own Prometheus metrics at /metrics (0: off; default {METRICS_PORT})",
    )
    parser.add_argument(
        "--service-monitor-label",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        type=_label,
        help="extra label on every ServiceMonitor (repeatable), e.g. release=kube-prometheus-stack so "
        "that a Prometheus' serviceMonitorSelector picks them up",
    )
    parser.add_argument(
        "--server-image",
        metavar="IMAGE",
        default=os.environ.get("CONVEYOR_SERVER_IMAGE", DEFAULT_IMAGE),
        type=_image,
        help=f"server image of InferenceServices without spec.image (env CONVEYOR_SERVER_IMAGE; default "
        f"{DEFAULT_IMAGE})",
    )
    parser.add_argument(
        "--network-policy-from",
        metavar="JSON",
        type=_peers,
        default=None,
        help="render a NetworkPolicy per InferenceService admitting to its server pods only pods of its "
        'namespace and these NetworkPolicyPeers, a JSON list, e.g. \'[{"namespaceSelector": {"matchLabels": '
        '{"kubernetes.io/metadata.name": "monitoring"}}}]\' (\'[]\': the namespace only)',
    )
    keda = parser.add_argument_group("KEDA", "the ScaledObjects of `autoscaling.engine: keda`")
    keda.add_argument(
        "--keda-prometheus-url",
        metavar="URL",
        type=_url,
        default=None,
        help="the Prometheus KEDA's triggers query (default: --prometheus-url, else "
        "http://prometheus-operated.monitoring.svc:9090)",
    )
    keda.add_argument(
        "--keda-authentication",
        metavar="[KIND/]NAME",
        type=_authentication,
        default=None,
        help="a TriggerAuthentication (in each InferenceService's namespace) or "
        "ClusterTriggerAuthentication/NAME holding the Prometheus credentials",
    )
    keda.add_argument(
        "--keda-auth-modes",
        metavar="MODES",
        type=_auth_modes,
        default=None,
        help="KEDA's authModes: bearer, basic, tls or custom, or several comma-separated (tls,basic)",
    )
    keda.add_argument(
        "--keda-polling-interval",
        metavar="SECONDS",
        type=_positive_int,
        default=KEDA_POLLING_INTERVAL_SECONDS,
        help=f"seconds between KEDA's queries (default {KEDA_POLLING_INTERVAL_SECONDS})",
    )
    parser.add_argument("--verbose", "-v", action="store_true", help="debug logging")
    return parser


def _url(text: str) -> str:
    if not re.match(f"^{URL_PATTERN}", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not an http:// or https:// URL")
    return text


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0")
    return value


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return int(text)


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0-65535; 0: off)")
    return int(text)


def _name(text: str) -> str:
    if not re.match(DNS1123_SUBDOMAIN, text) or len(text) > 253:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a Kubernetes object name (lowercase, digits, '-', '.')"
        )
    return text


def _image(text: str) -> str:
    if not text or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError(f"{text!r} is not an image reference")
    return text


def _auth_modes(text: str) -> str:
    if not re.match(f"^{KEDA_AUTH_MODES}$", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not bearer, basic, tls or custom (comma-separated)")
    return text


def _priority(text: str) -> int:
    if text == "random":
        return random.SystemRandom().randint(1, 2**31 - 1)
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither an integer nor 'random'") from None


_AUTHENTICATION_KINDS = ("TriggerAuthentication", "ClusterTriggerAuthentication")


def _authentication(text: str) -> tuple[str, str]:
    kind, _, name = text.rpartition("/")
    kind = kind or ("TriggerAuthentication" if "/" not in text else "")
    if kind not in _AUTHENTICATION_KINDS or not re.match(DNS1123_SUBDOMAIN, name):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not [TriggerAuthentication/|ClusterTriggerAuthentication/]NAME"
        )
    return kind, name


_PEER_KEYS = {"podSelector", "namespaceSelector", "ipBlock"}


def _peers(text: str) -> list[dict[str, Any]]:
    try:
        peers = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(peers, list) or not all(
        isinstance(p, dict) and p and set(p) <= _PEER_KEYS for p in peers
    ):
        raise argparse.ArgumentTypeError(
            "must be a JSON list of NetworkPolicyPeer objects (podSelector, namespaceSelector, ipBlock)"
        )
    return peers


def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not re.match(LABEL_KEY, key) or not re.match(LABEL_VALUE, value):
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE with a label key and value")
    return key, value


class _QuietRoutine(logging.Filter):
    """Drops kopf's INFO lines for routine handlers: "Timer 'autoscale' succeeded." every autoscaling
    step, "Handler 'on_child' succeeded." on every status change of a child or pod, and on every
    deletion "Handler 'on_deleted' succeeded.". Their failures, and everything our handlers log, stay."""

    # kopf names a timer by its id and field: "Timer 'autoscale/spec.autoscaling' succeeded."
    _ROUTINE = ("Timer 'autoscale", "Handler 'on_child'", "Handler 'on_pod'", "Handler 'on_deleted'")

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno <= logging.INFO and record.getMessage().startswith(self._ROUTINE))


def check_permissions(namespaces: list[str], *, peering: str | None) -> tuple[str | None, str | None]:
    """(problem, peering): problem is None when the operator's identity holds every permission it needs
    in `namespaces` (empty: the whole cluster) and, with peering, kopf's peering CRD exists; otherwise
    what is wrong, worded for the log. peering: None for --standalone, "" for kopf's default peering,
    else the --peering name; returned as it will run. Without the peering CRD the default peering is
    dropped with a warning (kopf would run unpeered, saying nothing); a named one cannot be (kopf would
    wait for the CRD forever), so that is a problem."""
    import urllib3
    from kubernetes.client.exceptions import ApiException
    from kubernetes.config import ConfigException

    from conveyor.operator.cluster import AccessReview, api_message, load_api_client
    from conveyor.operator.permissions import missing_message, peering_crd, required_checks

    log = logging.getLogger("conveyor.operator")
    try:
        review = AccessReview(load_api_client())
        if peering is not None and not review.has_crd(peering_crd(namespaces)):
            crd = peering_crd(namespaces)
            if peering:
                return (
                    f"--peering {peering} needs kopf's peering CRD {crd}, which is not installed: apply "
                    "charts/conveyor/crds/ (helm install does), or run with --standalone"
                ), peering
            log.warning(
                "kopf's peering CRD %s is not installed (charts/conveyor/crds/): running without peering, "
                "as with --standalone; run one operator replica only",
                crd,
            )
            peering = None
        missing = review.missing_permissions(required_checks(namespaces, peering=peering is not None))
        identity = review.identity() if missing else None
    except ConfigException as exc:
        return f"no Kubernetes credentials (in-cluster service account or kubeconfig): {exc}", peering
    except ApiException as exc:
        return f"cannot check the operator's permissions: the API server answered {api_message(exc)}", peering
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        return f"cannot reach the Kubernetes API server to check the operator's permissions: {exc}", peering
    return (missing_message(missing, identity) if missing else None), peering


def build_memo(args: argparse.Namespace) -> OperatorMemo:
    """The operator's state from its parsed flags, for `kopf.run(memo=...)` (the cluster is connected
    by the start-up handler)."""
    from conveyor.operator.memo import OperatorMemo, OperatorSettings
    from conveyor.operator.scaling import prometheus_source

    keda = KedaSettings(
        args.keda_prometheus_url or args.prometheus_url,
        args.keda_authentication,
        args.keda_auth_modes,
        args.keda_polling_interval,
    )
    settings = OperatorSettings(
        server_image=args.server_image,
        namespaces=tuple(args.namespace),
        service_monitor_labels=dict(args.service_monitor_label),
        network_policy_from=args.network_policy_from,
        keda=keda,
    )
    return OperatorMemo(settings, prometheus_source(args.prometheus_url, args.autoscale_interval))


def main(argv: list[str] | None = None) -> int:
    """Run the operator until interrupted; returns the exit status (1: a permission it needs is
    missing, or the API server could not be asked)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # `kill -USR1 PID` prints every thread's stack to stderr: what a stuck operator is waiting for.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # One line per Prometheus query and per timer run would drown the decisions in the log.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("kopf.objects").addFilter(_QuietRoutine())
    # The permission check's client retries each request; an unreachable API server is told in one
    # line below, not in a WARNING per retry of every check.
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
    peering = None if args.standalone else (args.peering or "")
    problem, peering = check_permissions(list(args.namespace), peering=peering)
    if problem is not None:
        logging.getLogger("conveyor.operator").error("not starting: %s", problem)
        return 1
    logging.getLogger("conveyor.operator").info("permission check passed (operator/permissions.py)")
    # Importing registers the handlers with kopf's default registry.
    from conveyor.operator import handlers

    handlers.register_autoscale_timer(args.autoscale_interval)
    memo = build_memo(args)
    if args.metrics_port:
        try:
            prometheus_client.start_http_server(args.metrics_port)
        except OSError as exc:
            logging.getLogger("conveyor.operator").error(
                "not starting: cannot serve the operator's metrics on port %d (%s): choose another "
                "--metrics-port, or 0 to turn them off",
                args.metrics_port,
                exc.strerror or exc,
            )
            return 1

    namespaces = list(args.namespace)
    kopf.run(
        memo=memo,
        standalone=peering is None,
        priority=args.priority,
        peering_name=args.peering,
        liveness_endpoint=args.liveness,
        clusterwide=not namespaces,
        namespaces=namespaces,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
